"""HBF decision cost: host-side planning per decode step, and the scoring + top-k per layer.

    python -m h3d.bench.hbf_cost [--tokens 32768] [--steps 2000] [--sessions 1] [--shape embedded]
                                 [--picks 55] [--drift 0.1] [--write docs/BENCHMARKS.md]

Synthetic metadata with the embedded model's shape (30 layers, 3 KV heads, head_dim 64,
block_size 32): one session of `--tokens` tokens, an HBM budget of 1/6 of its blocks per layer,
the rest in DDR. Each step selects, per layer and per KV head, the sink, the recent window and 55
more blocks (a 2,048-token window per head) that drift slowly (90 % kept from the previous step,
as real selections do), and runs the tier manager's promotion/eviction of the heads' union
(`TierManager.promote`): `hbf_latency_us` is that planning (the union of the heads' lists
included), the copies excluded. The pools are 1 element wide: planning never touches bytes.
Promotions are capped as the engine caps them: the default `promote_mb_per_step` of the shape's
real blocks (bf16), shared by the sessions. Scoring (digest bound over all blocks per KV head +
top-k per head) is timed separately on real-sized digests.

`--shape llama3-8b` plans for the Llama-3-8B shape instead (32 layers, 8 KV heads), with each
session's picks handed over as a captured step hands them (`counted`: distinct and ascending, their
reads counted by the step) and HBM for 3/5 of the blocks: what a `many` step's commit plans.

`--picks` and `--drift` widen the selection and make it move: a model of random weights (the GPU
benchmarks' Llama-3-8B shape) attends almost uniformly, so `attention_entropy` widens its window
and each step's picks are nearly new. `--picks 186 --drift 0.5` hands over about 25,000 pairs a
step for each 32K session, about as many as a `many` step of `h3d.bench.serve` read on an H100.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from h3d.bench.report import write_section
from h3d.config import EngineConfig
from h3d.hbf.digests import DIGEST_TOKENS, block_scores
from h3d.hbf.policy import policy_named
from h3d.kv.blocks import SeqId
from h3d.kv.cache import KVCache

LAYERS, KV_HEADS, HEAD_DIM, HEADS, BS = 30, 3, 64, 9, 32
WARM_STEPS = 100  # planned before the timing starts: they fill HBM
PICKS = 55  # blocks each KV head picks beside the base ones: a 2,048-token window of 32-token blocks
DRIFT = 0.1  # the part of a head's picks that changes from one step to the next


SHAPES = {  # layers, KV heads, head size, the part of the blocks HBM holds, picks handed over as a captured step does
    "embedded": (LAYERS, KV_HEADS, HEAD_DIM, 1 / 6, False),
    "llama3-8b": (32, 8, 128, 3 / 5, True),
}


@dataclass
class Planned:
    latencies_us: list[float]  # each timed step's planning
    keys_per_step: float  # (layer, block) pairs handed to the promotion a step, all sessions (mean)
    promotions_per_step: float  # blocks promoted a step, the timed steps' mean
    promotion_cap: int  # at most this many a step: the default `promote_mb_per_step` of the shape's blocks


def planning(
    tokens: int,
    steps: int,
    seed: int = 0,
    sessions: int = 1,
    shape: str = "embedded",
    picks_per_head: int = PICKS,
    drift: float = DRIFT,
) -> Planned:
    """`sessions` sessions of `tokens` tokens decoding together (one promotion call a step for
    all of them, as a batch's commit makes it), HBM a part of their blocks (`SHAPES`); each KV
    head picks `picks_per_head` blocks beside the base ones, `drift` of them new each step."""
    layers, kv_heads, head_dim, part, counted = SHAPES[shape]
    nb = tokens // BS
    hbm_per_layer = int(nb * sessions * part)
    kv = KVCache(
        num_layers=layers, num_kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"),
        hbm_regions=hbm_per_layer, ddr_slots=nb * layers * sessions, block_size=BS, hbf=EngineConfig().hbf,
    )  # fmt: skip
    blocks, tiers = kv.blocks, kv.tiers
    # The pools are one element wide; promotions are capped as the engine caps them: the default
    # `promote_mb_per_step` over the shape's real block (bf16 K and V).
    block_bytes = BS * kv_heads * head_dim * 2 * 2
    cap = kv.promoter.promote_blocks_per_step = int(EngineConfig().promote_mb_per_step * 2**20) // block_bytes
    seqs = [SeqId(1 + i) for i in range(sessions)]
    for seq in seqs:
        kv.open(seq, "bench", policy_named("attention_entropy"))
    # Appended in turns of 32 blocks, so that each session holds an equal part of HBM (as the
    # engine's fair shares leave them; one after the other, the first sessions would hold all of
    # it, and only the session that found HBM full midway would have misses to promote).
    for start in range(0, tokens, 32 * BS):
        for seq in seqs:
            blocks.append(seq, min(32 * BS, tokens - start))
    rng = np.random.default_rng(seed)
    base = np.union1d([0], np.arange(nb - 8, nb))
    # attention_entropy's selection: `picks_per_head` top blocks per KV head beside the 9 base ones
    # (55: a 2048-token window); each head's picks drift by `drift` per step. The tiers keep the
    # union of the heads' picks.
    picks = rng.integers(1, nb - 9, (sessions, layers, kv_heads, picks_per_head))  # [S, L, Hkv, picks]
    width = blocks.table(seqs[0]).capacity
    rows = np.arange(layers)[:, None, None] * width
    keep = {seq: base for seq in seqs}
    protect = {seq: nb - 1 for seq in seqs}
    handed = promoted = 0
    for step in range(steps):
        moved = rng.random(picks.shape) < drift
        picks[moved] = rng.integers(1, nb - 9, int(moved.sum()))
        # What the device hands the host: every head's list, base included, as (layer, block) keys.
        keys = {
            seq: np.concatenate([(picks[i] + rows).ravel(), (base[None, :] + rows[:, 0]).ravel()])
            for i, seq in enumerate(seqs)
        }
        if counted:  # the union of each session's heads, as the captured step's picks come back
            keys = {seq: np.unique(k) for seq, k in keys.items()}
        handed += sum(len(k) for k in keys.values())
        tiers.begin_step(seqs)
        before = tiers.counters.promote_count
        kv.promoter.promote(keys, protect, keep, counted)
        if step >= WARM_STEPS:
            promoted += tiers.counters.promote_count - before
    # after warm-up (the first steps fill HBM)
    timed = max(1, steps - WARM_STEPS)
    return Planned(kv.promoter.latencies_us[WARM_STEPS:], handed / steps, promoted / timed, cap)


def scoring_us(tokens: int, repeats: int = 50) -> float:
    nb = tokens // BS
    parts = BS // DIGEST_TOKENS  # the default digests: 4 parts of 8 tokens per block
    digests = torch.randn(KV_HEADS, nb, parts, 2, HEAD_DIM).sort(dim=3).values
    q = torch.randn(HEADS, HEAD_DIM)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scores = block_scores(q, digests, per_head=True)  # [Hkv, nb]
        torch.topk(scores, 55, dim=-1)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=2000, help=f"steps planned (the first {WARM_STEPS} not timed)")
    parser.add_argument("--sessions", type=int, default=1, help="sessions decoding together (one promotion a step)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="embedded",
                        help="layers and KV heads planned for (llama3-8b: also the captured step's picks)")  # fmt: skip
    parser.add_argument(
        "--picks",
        type=int,
        default=PICKS,
        help=f"blocks each KV head picks per layer beside the sink and recent ones (default {PICKS})",
    )
    parser.add_argument(
        "--drift",
        type=float,
        default=DRIFT,
        help=f"the part of a head's picks that changes each step, 0 to 1 (default {DRIFT})",
    )
    parser.add_argument("--write", default=None)
    args = parser.parse_args()
    if args.steps <= WARM_STEPS:
        parser.error(f"--steps must be more than the {WARM_STEPS} steps that fill HBM first (not timed)")
    if not 0 <= args.drift <= 1:
        parser.error(f"--drift must be within 0 and 1, got {args.drift}")
    if not 1 <= args.picks <= args.tokens // BS - 10:
        most = args.tokens // BS - 10
        parser.error(f"--picks must be within 1 and {most} (the blocks of --tokens less the base ones)")
    planned = planning(args.tokens, args.steps, sessions=args.sessions, shape=args.shape, picks_per_head=args.picks,
                       drift=args.drift)  # fmt: skip
    lat = np.array(planned.latencies_us)
    score = scoring_us(args.tokens)
    table = "\n".join(
        [
            "| figure | value |",
            "|---|---:|",
            f"| hbf_latency_us p50 (host planning per step, all {SHAPES[args.shape][0]} layers) "
            f"| {np.percentile(lat, 50):.0f} |",
            f"| hbf_latency_us p99 | {np.percentile(lat, 99):.0f} |",
            f"| (layer, block) pairs planned per step, all sessions | {planned.keys_per_step:.0f} |",
            f"| blocks promoted per step, all sessions (at most {planned.promotion_cap}) "
            f"| {planned.promotions_per_step:.0f} |",
            f"| scoring + top-k per layer, CPU, {args.tokens // BS} blocks (µs, median) | {score:.0f} |",
        ]
    )
    print(table)
    if args.write:
        meta = (
            f"Measured {dt.date.today().isoformat()} on the 2-core CPU host, {args.sessions} session(s) of "
            f"{args.tokens} tokens, {args.steps} steps (the first {WARM_STEPS} dropped). "
            "Goal: p99 <= 200 µs (one session).\n\n"
            "Command: `python -m h3d.bench.hbf_cost "
            f"--tokens {args.tokens} --steps {args.steps} --sessions {args.sessions} --shape {args.shape}`"
        )
        write_section(Path(args.write), f"{meta}\n\n{table}", "hbf-cost")


if __name__ == "__main__":
    main()
