"""`python -m h3d.bench.longctx` on a tiny checkpoint: every task under every configuration, rows
and per-prompt entries as documented. Its contexts are shorter than every budget, so each
sparse configuration reads every block and must answer exactly as `exact` did (the prefill
once, rewound between configurations)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from h3d.bench import longctx
from h3d.bench.longtasks import TASKS


def test_the_suite_runs_every_task_under_every_configuration(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "longctx.json"
    longctx.main(
        ["--model", str(checkpoint("llama_gqa4_tied")), "--contexts", "480", "--smoke", "--max-tokens", "6",
         "--out", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == len(TASKS) * len(longctx.CONFIGS)
    assert all(r["total"] == 1 and r["context"] == 480 for r in rows)
    assert {(r["policy"], r["budget"], r["resize"]) for r in rows} == {
        (c.policy, c.budget, c.resize) for c in longctx.CONFIGS
    }
    for task in TASKS:
        runs = [p for p in result["prompts"] if p["task"] == task]
        assert len(runs) == len(longctx.CONFIGS)
        assert all(480 - 6 - 3 * longctx.MARGIN <= p["prompt_tokens"] <= 480 - 6 for p in runs)  # room for the answer
        assert all(p["answer"] == runs[0]["answer"] for p in runs), task  # the window holds the whole context
    assert "| task | context |" in longctx.table(rows)
