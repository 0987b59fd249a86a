"""CPU benchmark: h3d against `transformers` side by side, in one process, on one model.

    python -m h3d.bench.cpu --model DIR [--contexts 1024 4096] [--decode-tokens 32] [--write docs/BENCHMARKS.md]

For each context length: prefill tokens/s (h3d's chunked prefill into the paged cache vs one
`transformers` forward with a DynamicCache) and decode ms/token (median over the decode steps,
greedy, batch 1), then h3d's ratio to transformers. Both run in fp32 on the same threads; the
runs alternate so that drift in the machine's speed hits both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from h3d.bench.report import write_section
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.session import TokenDelta
from h3d.model.llama import Linear


@dataclass(frozen=True, slots=True)
class Row:
    context: int
    h3d_prefill_tps: float
    hf_prefill_tps: float
    h3d_decode_ms: float
    hf_decode_ms: float


def _h3d_run(engine: Engine, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    session = engine.create_session()
    t0 = time.perf_counter()
    engine.append(session, token_ids=ids)
    prefill_s = time.perf_counter() - t0
    stamps = []
    params = engine.with_sampling(max_tokens=decode_tokens + 1, ignore_eos=True)
    for event in engine.generate(session, params=params):
        if isinstance(event, TokenDelta):
            stamps.append(time.perf_counter())
    engine.close_session(session)
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return len(ids) / prefill_s, statistics.median(steps) * 1000


@torch.inference_mode()
def _hf_run(model: torch.nn.Module, ids: list[int], decode_tokens: int) -> tuple[float, float]:
    from transformers import DynamicCache

    x = torch.tensor([ids])
    cache = DynamicCache()
    t0 = time.perf_counter()
    out = model(input_ids=x, past_key_values=cache, use_cache=True)
    prefill_s = time.perf_counter() - t0
    nxt = out.logits[:, -1:].argmax(-1)
    steps = []
    for _ in range(decode_tokens):
        t = time.perf_counter()
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - t)
    return len(ids) / prefill_s, statistics.median(steps) * 1000


@torch.inference_mode()
def weight_floor_ms(engine: Engine, repeats: int = 5) -> float:
    """One decode step's weight reads alone: every projection and the LM head applied to one row."""
    mats = [m.weight_t for m in engine.model.modules() if isinstance(m, Linear)]
    rows = {w.shape[0]: torch.randn(1, w.shape[0], dtype=w.dtype) for w in mats}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for w in mats:
            rows[w.shape[0]] @ w
        times.append(time.perf_counter() - t0)
    return min(times) * 1000


def run(model_dir: str, contexts: list[int], decode_tokens: int, repeats: int) -> tuple[list[Row], float]:
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig.build(model=model_dir, hbm_mb=4096, policy="exact"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in contexts:
        ids = torch.randint(100, engine.model.config.vocab_size - 100, (n,), generator=gen).tolist()
        h3d_runs, hf_runs = [], []
        _h3d_run(engine, ids[:256], 4)  # warm-up
        _hf_run(hf, ids[:256], 4)
        for _ in range(repeats):
            h3d_runs.append(_h3d_run(engine, ids, decode_tokens))
            hf_runs.append(_hf_run(hf, ids, decode_tokens))
        rows.append(
            Row(
                context=n,
                h3d_prefill_tps=max(r[0] for r in h3d_runs),
                hf_prefill_tps=max(r[0] for r in hf_runs),
                h3d_decode_ms=min(r[1] for r in h3d_runs),
                hf_decode_ms=min(r[1] for r in hf_runs),
            )
        )
        print(_table(rows[-1:]), flush=True)
    return rows, weight_floor_ms(engine)


def _table(rows: list[Row]) -> str:
    lines = [
        "| context | h3d prefill tok/s | transformers prefill tok/s | prefill ratio "
        "| h3d decode ms/tok | transformers decode ms/tok | decode ratio (speed) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.context} | {r.h3d_prefill_tps:.0f} | {r.hf_prefill_tps:.0f} "
            f"| {r.h3d_prefill_tps / r.hf_prefill_tps:.2f}x "
            f"| {r.h3d_decode_ms:.1f} | {r.hf_decode_ms:.1f} | {r.hf_decode_ms / r.h3d_decode_ms:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write", type=Path, default=None, help="update this markdown file's CPU table")
    args = parser.parse_args()
    rows, floor = run(args.model, args.contexts, args.decode_tokens, args.repeats)
    table = _table(rows) + (
        f"\n\nWeight-read floor of one decode step (every projection and the LM head applied to one row, "
        f"no attention, no other op): {floor:.1f} ms."
    )
    print(table)
    if args.write:
        import transformers

        meta = (
            f"Measured {dt.date.today().isoformat()} on {platform.processor() or platform.machine()} "
            f"({torch.get_num_threads()} threads), torch {torch.__version__}, transformers {transformers.__version__}, "
            f"fp32, batch 1, random prompt ids; best of {args.repeats} alternating runs; decode is the median step "
            f"of {args.decode_tokens}.\n\nCommand: `python -m h3d.bench.cpu --model MODEL "
            f"--contexts {' '.join(map(str, args.contexts))} --decode-tokens {args.decode_tokens}`"
        )
        write_section(args.write, f"{meta}\n\n{table}", "bench-cpu")


if __name__ == "__main__":
    main()
