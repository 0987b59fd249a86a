"""The device-time profile (`h3d.bench.profile`) on the CPU (`--tiny`): the engine's append and
decode and transformers' forward run under the profiler and their tables and JSON are written, so
that it does not rot between runs on a card (a CPU profile has no device time to report)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from h3d.bench import profile


def test_tiny_profile_writes_its_json_and_tables(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--tiny", "--context", "600", "--tokenizer", str(checkpoint("llama_gqa4_tied")),
            "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    assert profile.main(argv) == 0
    data = json.loads((out / "profile.json").read_text())
    assert data["context"] == 600 and data["card"] == "cpu"
    assert len(data["engine_append_s"]) == 2 and all(s > 0 for s in data["engine_append_s"])
    assert data["engine_append_one_go_s"] > 0 and data["engine_append_profiled_s"] > 0
    assert data["decode_itl_ms_p50"] > 0 and data["decode_wall_ms_per_token"] > 0
    assert len(data["hf_prefill_s"]) == 2 and data["hf_prefill_profiled_s"] > 0
    for name in ("engine_append", "decode", "hf_prefill"):
        table = (out / f"{name}.txt").read_text()
        assert "Self CPU" in table and len(table.splitlines()) > 5
