"""What a parallel region costs the CPU's tiny attention ops, by OpenMP wait policy.

    python -m h3d.bench.smallops [--threads 2] [--write docs/BENCHMARKS.md]

A short sequence's decode attention (`h3d.kv.attention.run_attention`) is a dozen ops on tensors
of a few KiB. Some of them (`bmm`, `softmax`) open an OpenMP parallel region whatever their size.
This times them, and one layer of a decode step of 56 short sequences (the tiny load's shape: 3 KV
heads of 64, 9 query heads, 30-63 tokens in blocks of 16), in child processes started with
libgomp's default wait policy (its threads spin between regions) and with
`OMP_WAIT_POLICY=PASSIVE` (what `h3d serve` sets: they sleep), at `--threads` threads and inside
`one_thread` (what `paged_attention` does for such sequences). Microseconds per call, best of 5
repetitions of 200 calls.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

POLICIES = {"spinning (libgomp's default)": {}, "passive (h3d serve)": {"OMP_WAIT_POLICY": "PASSIVE"}}


def _best_us(fn: Callable[[], object], calls: int = 200, rounds: int = 5) -> float:
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def measure(threads: int) -> dict[str, float]:
    """In this process (its wait policy fixed when torch loaded): µs per call of each case."""
    import numpy as np
    import torch

    from h3d.kv.attention import Pools, one_thread, run_attention

    torch.set_num_threads(threads)
    hkv, g, d, bs = 3, 3, 64, 16
    q1 = torch.randn(hkv, g, d)
    k = torch.randn(hkv, 32, d)
    scores = torch.bmm(q1, k.transpose(1, 2))[..., :30]
    probs = torch.softmax(scores, dim=-1)
    pools = Pools(
        k=(torch.randn(hkv, 4096, bs, d), torch.randn(hkv, 64, bs, d)),
        v=(torch.randn(hkv, 4096, bs, d), torch.randn(hkv, 64, bs, d)),
    )
    rng = np.random.default_rng(0)
    lens = [int(n) for n in rng.integers(30, 64, 56)]
    runs = [[(0, 1 + 5 * i, -(-n // bs))] for i, n in enumerate(lens)]
    q = torch.randn(len(lens), hkv * g, d)

    def layer() -> None:
        for i, n in enumerate(lens):
            run_attention(q[i : i + 1], pools, runs[i], n, 0.125)

    def layer_one_thread() -> None:
        with one_thread():
            layer()

    return {
        "bmm [3,3,64] x [3,64,32]": _best_us(lambda: torch.bmm(q1, k.transpose(1, 2))),
        "softmax [3,3,30]": _best_us(lambda: torch.softmax(scores, dim=-1)),
        "bmm [3,3,30] x [3,30,64]": _best_us(lambda: torch.bmm(probs, k[:, :30])),
        "a layer of 56 sequences": _best_us(layer, calls=20),
        "the same inside one_thread": _best_us(layer_one_thread, calls=20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads in the timed cases")
    parser.add_argument("--write", type=Path, default=None, help="write the table into this Markdown file")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.threads)))
        return
    columns: dict[str, dict[str, float]] = {}
    for name, env in POLICIES.items():
        base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        cmd = [sys.executable, "-m", "h3d.bench.smallops", "--child", "--threads", str(args.threads)]
        done = subprocess.run(cmd, env={**base, **env}, capture_output=True, text=True, check=True)
        columns[name] = json.loads(done.stdout.strip().splitlines()[-1])
    cases = list(next(iter(columns.values())))
    head = "| µs per call | " + " | ".join(f"{args.threads} threads, {n}" for n in columns) + " |"
    rows = [f"| {c} | " + " | ".join(f"{columns[n][c]:,.1f}" for n in columns) + " |" for c in cases]
    table = "\n".join([head, "|---|" + "---:|" * len(columns), *rows])
    print(table)
    if args.write is not None:
        from h3d.bench.report import write_section

        meta = (
            f"Measured {dt.date.today().isoformat()} on the {os.cpu_count()}-CPU host. Command: "
            f"`python -m h3d.bench.smallops --threads {args.threads}`"
        )
        write_section(args.write, f"{meta}\n\n{table}", "smallops")


if __name__ == "__main__":
    main()
