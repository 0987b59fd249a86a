"""Generate h3d's Python gRPC code from protos/ into h3d/_proto/ (committed), or check it is current.

    python protos/generate.py          # regenerate (make proto)
    python protos/generate.py --check  # exit 1 if the committed code differs (make test runs it)

Needs grpcio-tools (a dev dependency). The generated modules import each other as `h3.v1.*`;
they are rewritten to `h3d._proto.h3.v1.*` so that they live inside the package.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
OUT = ROOT / "h3d" / "_proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    sources = sorted(p.relative_to(PROTOS).as_posix() for p in PROTOS.rglob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTOS}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    if protoc.main(args + sources) != 0:
        raise SystemExit("protoc failed")
    files = []
    for path in sorted(out.rglob("*.py*")):
        text = path.read_text()
        text = re.sub(r"^from h3\.v1 import", "from h3d._proto.h3.v1 import", text, flags=re.M)
        path.write_text(text)
        files.append(path)
    for folder in {p.parent for p in files} | {out}:
        while folder != out.parent:
            (folder / "__init__.py").touch()
            folder = folder.parent
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp) / "_proto"
        fresh.mkdir()
        generate(fresh)
        names = sorted(p.relative_to(fresh) for p in fresh.rglob("*") if p.is_file())
        if args.check:
            stale = [n for n in names if not (OUT / n).exists() or not filecmp.cmp(fresh / n, OUT / n, shallow=False)]
            if stale:
                print(f"h3d/_proto is stale ({', '.join(map(str, stale))}): run `make proto`", file=sys.stderr)
                return 1
            return 0
        shutil.rmtree(OUT, ignore_errors=True)
        shutil.copytree(fresh, OUT)
    print(f"generated {len(names)} files under {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
