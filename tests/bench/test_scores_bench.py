"""`python -m h3d.bench.scores --tiny`: each way of reading the digests is run under Triton's
interpreter and checked against the kernel's defaults (a child process: the interpreter must be
set before Triton's import)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_tiny_scores_bench_checks_each_way_against_the_defaults(tmp_path: Path) -> None:
    out = tmp_path / "scores.json"
    run = subprocess.run(
        [sys.executable, "-m", "h3d.bench.scores", "--tiny", "--out", str(out)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    table = json.loads(out.read_text())["ways"]
    assert [(r["flat"], r["tile"]) for r in table] == [(False, 64), (True, 16)]
    assert all(r["max_diff"] == 0 for r in table)
    assert "| True | 16 | 4 |" in run.stdout
