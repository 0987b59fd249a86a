"""`python -m h3d.bench.greedy` on a tiny Gemma 3 checkpoint (windows in play): h3d's greedy tokens
and transformers' agree, and the figures say so."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from h3d.bench import greedy


def test_greedy_bench_compares_h3d_with_transformers(
    checkpoint: Callable[[str], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "greedy.json"
    md = tmp_path / "BENCH.md"
    argv = ["greedy", "--model", str(checkpoint("gemma3_window")), "--prompt-tokens", "100", "--tokens", "12"]
    monkeypatch.setattr(sys, "argv", [*argv, "--json", str(out), "--write", str(md)])
    greedy.main()
    figures = json.loads(out.read_text())
    assert (figures["prompt_tokens"], figures["tokens"], figures["equal"]) == (100, 12, 12)
    assert figures["first_difference"] is None and (figures["sliding_layers"], figures["window"]) == (2, 24)
    assert "| greedy tokens equal | 12 of 12 |" in capsys.readouterr().out
    assert "<!-- greedy-gemma3_window:start -->" in md.read_text()
    monkeypatch.setattr(sys, "argv", [*argv, "--gguf", str(tmp_path / "missing.gguf")])
    with pytest.raises(SystemExit, match="no such file"):
        greedy.main()
