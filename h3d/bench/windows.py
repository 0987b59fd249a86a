"""What a sliding-window model's session holds in the tiers, against the same context without windows.

    python -m h3d.bench.windows --model data/models/gemma-3-270m [--tokens 32000] [--out F] [--write docs/BENCHMARKS.md]

One session through the engine at its defaults (what `h3d generate` and `h3d serve` build): a
prompt of `--tokens` tokens of real text (this checkout's docs/*.md and README.md, in that order,
cut to the count), then 8 greedy tokens. Printed: the model's layers by kind, the KV the context
takes with every layer kept (the arithmetic: tokens x layers x K+V bytes per token and layer), the
KV of the full layers alone plus, per sliding layer, its window and `window_keep_tokens` (what it
should come to), and what the tiers report: HBM and DDR in use, the window layers' part of HBM
(`window_hbm_bytes`), the blocks freed behind windows. DDR in use may hold copies of blocks HBM
holds too (demotions, promotions).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import time
from pathlib import Path
from typing import Any

MIB = 2**20


def prompt_ids(tokenizer: Any, tokens: int, root: Path) -> list[int]:
    """The first `tokens` token ids of the docs' text (repeated if it is shorter)."""
    files = [*sorted((root / "docs").glob("*.md")), root / "README.md"]
    text = "".join(f.read_text() for f in files)
    ids: list[int] = tokenizer.encode(text)
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def measure(model: str, tokens: int) -> dict[str, Any]:
    from h3d.config import EngineConfig
    from h3d.engine.engine import Engine
    from h3d.engine.sampling import SamplingParams

    engine = Engine(EngineConfig.build(model=model))
    cfg = engine.model.config
    ids = prompt_ids(engine.tokenizer, tokens, Path(__file__).resolve().parents[2])
    t0 = time.perf_counter()
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    engine.complete(sid, "", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - t0
    cached = engine.cached_tokens(sid)
    stats = engine.tier_stats()
    kv = engine.runner.kv
    per_layer_token = 2 * cfg.num_kv_heads * cfg.head_dim * kv.hbm.k.element_size()
    windows = [w for w in cfg.windows if w is not None]
    bs = kv.block_size
    keep = engine.config.window_keep_tokens
    window_kv = sum((-(-(w + keep) // bs) + 1) * bs for w in windows) * per_layer_token  # blocks kept, the partial one
    full_layers = cfg.num_layers - len(windows)
    engine.close()
    return {
        "model": Path(model).name, "dtype": str(kv.hbm.k.dtype).removeprefix("torch."), "tokens": cached,
        "layers": cfg.num_layers, "sliding_layers": len(windows), "window": windows[0] if windows else None,
        "block_size": bs, "window_keep_tokens": keep, "seconds": round(seconds, 1),
        "kv_all_layers_bytes": cached * cfg.num_layers * per_layer_token,
        "kv_goal_bytes": cached * full_layers * per_layer_token + window_kv,
        "hbm_used_bytes": stats.hbm_used_bytes, "ddr_used_bytes": stats.ddr_used_bytes,
        "window_hbm_bytes": stats.window_hbm_bytes, "window_freed_blocks": stats.window_freed_blocks,
        "hbm_capacity_bytes": stats.hbm_capacity_bytes,
    }  # fmt: skip


def table(r: dict[str, Any]) -> str:
    mib = lambda n: f"{n / MIB:,.1f}"  # noqa: E731
    sliding, window, keep = r["sliding_layers"], r["window"], r["window_keep_tokens"]
    rows = [
        ("context (tokens cached)", f"{r['tokens']:,}"),
        ("layers", f"{r['layers']}: {r['layers'] - r['sliding_layers']} global, {sliding} sliding (window {window})"),
        ("KV with every layer kept, MiB", mib(r["kv_all_layers_bytes"])),
        (f"KV of the global layers + per sliding layer its window and {keep} tokens, MiB", mib(r["kv_goal_bytes"])),
        ("HBM in use, MiB (of " + mib(r["hbm_capacity_bytes"]) + ")", mib(r["hbm_used_bytes"])),
        ("  of which sliding layers' windows, MiB", mib(r["window_hbm_bytes"])),
        ("DDR in use, MiB", mib(r["ddr_used_bytes"])),
        ("HBM + DDR in use, MiB", mib(r["hbm_used_bytes"] + r["ddr_used_bytes"])),
        ("blocks freed behind windows", f"{r['window_freed_blocks']:,}"),
    ]
    lines = ["| | |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model folder (a sliding-window model: Gemma 3, ...)")
    parser.add_argument("--tokens", type=int, default=32000, help="prompt tokens (default 32,000)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--write", type=Path, default=None, help="write the table into this Markdown file")
    args = parser.parse_args()
    result = measure(args.model, args.tokens)
    text = table(result)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.write is not None:
        from h3d.bench.report import write_section

        meta = (
            f"Measured {dt.date.today().isoformat()} on the {os.cpu_count()}-CPU host ({result['dtype']}, blocks of "
            f"{result['block_size']}, the engine's defaults; {result['seconds']} s). Command: "
            f"`python -m h3d.bench.windows --model data/models/{result['model']} --tokens {args.tokens}`"
        )
        write_section(args.write, f"{meta}\n\n{text}", "windows")


if __name__ == "__main__":
    main()
