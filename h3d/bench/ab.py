"""Two trees of h3d side by side on the GPU benchmark: the median over pairs of new / old.

Each pair is one run of `h3d.bench.gpu` from each tree on the same host, one after the other (the
old commit checked out in a second folder), alternating which goes first:

    (cd OLD && python3 -m h3d.bench.gpu --contexts 32768 131072 --no-hf --out /tmp/old-1.json)
    python3 -m h3d.bench.gpu --contexts 32768 131072 --no-hf --out /tmp/new-1.json

Then, with the runs listed in pair order:

    python -m h3d.bench.ab --old /tmp/old-*.json --new /tmp/new-*.json \\
        --out bench/results/DATE-h200-ab.json

writes `old` and `new` -> mode -> context -> `decode_ms_per_tok` and `prefill_s` (lists, one per
run, in pair order), `new` -> `captures_on_batch_change` (the new tree's batch-change phase,
summed over its runs; each run's phase in `new` -> `batch_change`), `ratio` -> field -> mode ->
context (the median of the per-pair ratios new / old), and prints them as a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from h3d.bench.gpu_report import H3D_MODES

FIELDS = ("decode_ms_per_tok", "prefill_s")


def collect(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """mode -> context -> field -> one value per run (None where a run lacks it)."""
    out: dict[str, Any] = {}
    for mode in H3D_MODES:
        contexts = sorted({c for r in runs for c in r["modes"].get(mode, {})}, key=int)
        for context in contexts:
            entries = [r["modes"].get(mode, {}).get(context, {}) for r in runs]
            out.setdefault(mode, {})[context] = {f: [e.get(f) for e in entries] for f in FIELDS}
    return out


def ratios(old: dict[str, Any], new: dict[str, Any], field: str) -> dict[str, dict[str, float | None]]:
    """mode -> context -> the median of the per-pair ratios new / old of `field`."""
    out: dict[str, dict[str, float | None]] = {}
    for mode, contexts in new.items():
        for context, fields in contexts.items():
            pairs = zip(old.get(mode, {}).get(context, {}).get(field, []), fields[field], strict=False)
            rs = [n / o for o, n in pairs if o and n]
            out.setdefault(mode, {})[context] = round(statistics.median(rs), 3) if rs else None
    return out


def table(result: dict[str, Any]) -> str:
    rows = ["| mode | context | old ms/tok (runs) | new ms/tok (runs) | median new/old | prefill new/old |"]
    rows.append("|---|---:|---|---|---:|---:|")
    for mode in H3D_MODES:
        for context, fields in result["new"].get(mode, {}).items():
            old = result["old"].get(mode, {}).get(context, {}).get("decode_ms_per_tok", [])
            new = fields["decode_ms_per_tok"]
            decode = result["ratio"]["decode_ms_per_tok"][mode][context]
            prefill = result["ratio"]["prefill_s"][mode][context]
            runs = f"{', '.join(map(str, old))} | {', '.join(map(str, new))}"
            rows.append(f"| {mode} | {context} | {runs} | {decode} | {prefill} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, nargs="+", required=True, help="the old tree's runs, in pair order")
    p.add_argument("--new", type=Path, nargs="+", required=True, help="the new tree's runs, in pair order")
    p.add_argument("--out", type=Path, default=None, help="write the merged JSON here")
    args = p.parse_args()
    if len(args.old) != len(args.new):
        p.error(f"{len(args.old)} old runs and {len(args.new)} new ones: give one of each per pair")
    old_runs = [json.loads(f.read_text()) for f in args.old]
    new_runs = [json.loads(f.read_text()) for f in args.new]
    old, new = collect(old_runs), collect(new_runs)
    changes = [r.get("batch_change") or {} for r in new_runs]
    result: dict[str, Any] = {
        "card": new_runs[0].get("card"),
        "dates": sorted({r.get("date") for r in old_runs + new_runs}),
        "old": old,
        "new": {
            **new,
            "captures_on_batch_change": sum(c.get("captures_on_batch_change", 0) for c in changes),
            "batch_change": changes,
        },
        "ratio": {f: ratios(old, new, f) for f in FIELDS},
    }
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
