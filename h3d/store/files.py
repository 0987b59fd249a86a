"""Files and folders the daemon creates (token logs, the KV archive): private, whatever the umask.

They hold users' contexts and the KV computed from them, so only the daemon's user may read them:
files are created 0600 and folders 0700. The mode given to `open`/`mkdir` is ANDed with the
umask (022 outside systemd gives 0644 to a plain `open(..., "w")`), so both are set again with
`fchmod`/`chmod` right after creation: no umask widens them, and none narrows them below what the
daemon needs itself. What exists already keeps its mode (an operator's choice). Pure Python.
"""

from __future__ import annotations

import os
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def create_file(path: Path, flags: int) -> int:
    """Create `path`, which must not exist (O_EXCL), mode FILE_MODE. -> a descriptor opened with `flags`."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_or_create(path: Path, flags: int) -> tuple[int, bool]:
    """Open `path` with `flags`, creating it (mode FILE_MODE) if missing. -> (descriptor, whether created)."""
    try:
        return create_file(path, flags), True
    except FileExistsError:
        return os.open(path, flags | os.O_CLOEXEC), False


def make_dirs(path: Path) -> None:
    """`path` as a folder: it and its missing parents are created, mode DIR_MODE."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        os.chmod(d, DIR_MODE)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")
