"""The GPU benchmark's own path on the CPU (`--tiny`): it runs end to end, writes the JSON the GPU
issue specifies and its markdown section, so that it does not rot between runs on a card. (Its
figures on a CPU mean nothing and are not kept.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIELDS = {"prefill_s", "decode_ms_per_tok", "peak_gpu_gb_beyond_weights", "hbm_hit_rate", "fetch_gb_per_step"}


def test_tiny_run_writes_the_specified_json_and_section(tmp_path: Path) -> None:
    out, doc = tmp_path / "run.json", tmp_path / "BENCHMARKS.md"
    doc.write_text("# Benchmarks\n\nkept\n")
    cmd = [sys.executable, "-m", "h3d.bench.gpu", "--tiny", "--steps", "2", "--no-hf", "--out", str(out)]
    cmd += ["--modes", "exact_full", "exact_25pct", "attention_entropy_3GiB", "--write", str(doc)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    data = json.loads(out.read_text())
    assert {"date", "card", "ceilings", "modes", "many_sessions"} <= set(data)
    contexts = {"512", "1024"}
    for mode in ("floor", "exact_full", "exact_25pct", "attention_entropy_3GiB"):
        assert set(data["modes"][mode]) == contexts, mode
        for entry in data["modes"][mode].values():
            assert set(entry) >= FIELDS, (mode, entry)
    full = data["modes"]["exact_full"]["1024"]
    assert full["decode_ms_per_tok"] > 0 and full["hbm_hit_rate"] == 1.0
    assert data["modes"]["exact_25pct"]["1024"]["hbm_hit_rate"] < 0.5  # a quarter of the blocks in HBM
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept\n") and "<!-- gpu-bench:start -->" in text
    assert "| exact_full | 1024 |" in text
    # Saved runs render again without measuring.
    again = subprocess.run(
        [sys.executable, "-m", "h3d.bench.gpu", "--from-json", str(out), "--write", str(doc)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    assert doc.read_text().count("<!-- gpu-bench:start -->") == 1


def test_every_bench_imports_and_writes_its_section(tmp_path: Path) -> None:
    """The benches outside `make test` share `h3d.bench.report`: each imports, and a section is
    replaced in place (not appended twice)."""
    import importlib

    from h3d.bench.report import write_section

    for name in ("cpu", "codecs", "gpu", "hbf_cost", "load", "restart", "retrieval"):
        importlib.import_module(f"h3d.bench.{name}")
    doc = tmp_path / "B.md"
    write_section(doc, "one", "x")
    write_section(doc, "two", "x")
    assert doc.read_text() == "# Benchmarks\n\n<!-- x:start -->\ntwo\n<!-- x:end -->\n"
