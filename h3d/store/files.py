"""Files and folders the daemon creates (token logs, the KV archive): private, whatever the umask.

They hold users' contexts and the KV computed from them, so only the daemon's user may read them:
files are created 0600 and folders 0700. The mode given to `open`/`mkdir` is ANDed with the
umask (022 outside systemd gives 0644 to a plain `open(..., "w")`), so both are set again with
`fchmod`/`chmod` right after creation: no umask widens them, and none narrows them below what the
daemon needs itself. What exists already keeps its mode (an operator's choice). Pure Python.

`FileOps` is the file system calls the token log and the archive make while they run, as one
object passed in (`TokenStore(files=...)`, `Archive(files=...)`), the real calls by default: a
test subclasses it to stand for a full disk, a short write, a crash between two calls or a slow
disk, and the code under test runs as it does in production.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

FILE_MODE = 0o600
DIR_MODE = 0o700
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers one pwritev takes


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
    return FileOps().open_or_create(path, flags)


def fsync_dir(path: Path) -> None:
    """fsync the folder `path`: the names created, renamed or deleted in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes) -> None:
    """`path` holding `data`, atomically: a temporary file beside it (mode FILE_MODE) written and
    fsynced, renamed over it, the folder fsynced. A crash leaves the old file or the new one."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = create_file(tmp, os.O_WRONLY)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)
    fsync_dir(path.parent)


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


class FileOps:
    """The file system calls of a running token log (`h3d.store.tokenlog`) or archive
    (`h3d.tiers.archive`, its compactions too): each method is one call, made as the method says
    and nothing more, so a subclass that overrides one sees every such call, in order, on the
    thread that makes it. Subclass it to inject a fault: raise OSError (ENOSPC: a full disk) or a
    BaseException (the process dying at that point) from a method, write part of the data
    (`super().write_all(fd, data[:n], offset)`, then raise: a torn write), return less than asked
    from `write` (a short write), sleep or wait in one (a slow disk). Stateless: one object may
    serve any number of stores.

    Not on it: reads (`os.pread`, reading a whole file), closes and creating the store's folder;
    and what runs while an archive opens (its lock, the identity file, replaying and cutting back
    the manifest and the segments), which reads what the calls here left.
    """

    def open(self, path: Path, flags: int) -> int:
        """An existing file opened with `flags` (and O_CLOEXEC). -> the descriptor."""
        return os.open(path, flags | os.O_CLOEXEC)

    def create(self, path: Path, flags: int) -> int:
        """A new file, mode FILE_MODE (`create_file`: refused if `path` exists). -> the descriptor."""
        return create_file(path, flags)

    def open_or_create(self, path: Path, flags: int) -> tuple[int, bool]:
        """`create`, or `open` if `path` exists already. -> (descriptor, whether created)."""
        try:
            return self.create(path, flags), True
        except FileExistsError:
            return self.open(path, flags), False

    def write(self, fd: int, data: bytes | memoryview) -> int:
        """One `os.write` at the file's position. -> the bytes written (fewer than `data`: a short write)."""
        return os.write(fd, data)

    def write_all(self, fd: int, data: bytes | Sequence[Buffer], offset: int) -> None:
        """All of `data` at `offset` (`os.pwrite` until done): the offsets asked for are the ones
        written. `data` may be a list of buffers, written one after another (`os.pwritev`, without
        joining them first: a batch of archive records is written as it was encoded)."""
        if isinstance(data, (bytes, bytearray, memoryview)):
            view = memoryview(data)
            while view:
                done = os.pwrite(fd, view, offset)
                view, offset = view[done:], offset + done
            return
        views = [v for v in (memoryview(x).cast("B") for x in data) if v.nbytes]
        i = 0
        while i < len(views):
            done = os.pwritev(fd, views[i : i + _IOV_MAX], offset)
            offset += done
            while i < len(views) and done >= views[i].nbytes:
                done -= views[i].nbytes
                i += 1
            if done:
                views[i] = views[i][done:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, path: Path) -> None:
        """`fsync_dir(path)` (its own method: a folder's fsync does not go through `fsync`)."""
        fsync_dir(path)

    def truncate(self, fd: int, size: int) -> None:
        """`os.ftruncate`: the file cut back (or extended with zeros) to `size` bytes."""
        os.ftruncate(fd, size)

    def replace(self, src: Path, dst: Path) -> None:
        """`os.replace`: `src` renamed over `dst` at once."""
        os.replace(src, dst)

    def unlink(self, path: Path, missing_ok: bool = False) -> None:
        path.unlink(missing_ok=missing_ok)
