"""How fast the captured step's digest scores run (`h3d.kernels.select.scores`), by how the kernel
reads the digests.

    python -m h3d.bench.scores [--batch 16] [--context 32768] [--out FILE]

The `many` phase's shape by default: 16 sessions of 32K tokens, a Llama-3-8B layer (8 KV heads of
128, 32 query heads), blocks of 32 tokens with a digest every 8 (4 parts a block), the arena in
bf16, the raw bounds written too (the entropy's layer). Each way (`flat`, `tile`, `num_warps`) is
checked against the kernel's defaults (the masked and raw bounds within 1e-3) and timed with CUDA
events: µs a launch, the digests' GB/s, and ms a step for the 30 sparse layers of the `many`
step. With `--tiny` it runs a small shape under Triton's interpreter (the test of the code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

WAYS: list[dict[str, Any]] = [
    {"flat": False, "tile": 64},
    {"flat": False, "tile": 64, "num_warps": 8},
    {"flat": False, "tile": 32},
    {"flat": False, "tile": 32, "num_warps": 2},
    {"flat": False, "tile": 128, "num_warps": 8},
    {"flat": True, "tile": 8},
    {"flat": True, "tile": 16},
    {"flat": True, "tile": 16, "num_warps": 8},
    {"flat": True, "tile": 32, "num_warps": 8},
    {"flat": True, "tile": 64, "num_warps": 8},
]
INTERPRETED = [WAYS[0], {"flat": True, "tile": 16}]  # --tiny: the parts in turn, and the defaults' way
SPARSE_LAYERS = 30  # Llama-3-8B's 32 layers less the 2 dense ones


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.scores", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="sessions in the step")
    p.add_argument("--context", type=int, default=32768, help="tokens of each session")
    p.add_argument("--reps", type=int, default=100, help="timed launches per way")
    p.add_argument("--tiny", action="store_true", help="a small shape under TRITON_INTERPRET=1 (no timing)")
    p.add_argument("--out", type=Path, default=None, help="the table as JSON")
    args = p.parse_args(argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton's import
    import torch

    from h3d.kernels import select

    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        print("h3d.bench.scores: needs a CUDA device (or --tiny)", file=sys.stderr)
        return 1
    dev = torch.device("cuda" if cuda else "cpu")
    b, hkv, group, d, bs, parts = (args.batch, 8, 4, 128, 32, 4) if not args.tiny else (2, 2, 4, 16, 32, 4)
    w = (args.context if not args.tiny else 2048) // bs
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = b * w * parts
    arena = torch.randn(hkv, rows + parts, 2, d, generator=g).sort(dim=2).values.to(dev, dtype)
    q = torch.randn(b, hkv * group, d, generator=g).to(dev, dtype)
    base = torch.arange(b, dtype=torch.int64, device=dev) * w * parts
    nb = torch.full((b,), w, dtype=torch.int64, device=dev)
    live = nb * parts
    take = torch.zeros(b, dtype=torch.int64, device=dev)
    anchors = torch.zeros(b, hkv, 0, dtype=torch.int64, device=dev)

    def run(way: dict[str, Any]) -> tuple[Any, Any]:
        """The masked and raw bounds, written into this call's buffers (sinks 1, recent 8)."""
        masked = torch.empty(b, hkv, w, dtype=torch.float32, device=dev)
        raw = torch.empty_like(masked)
        select.scores(masked, q, arena, parts, base, nb, live, take, anchors, 1, 8, raw, **way)
        return masked, raw

    want = run({})
    digest_bytes = b * hkv * w * parts * 2 * d * arena.element_size()
    table = []
    for way in WAYS if cuda else INTERPRETED:
        got = run(way)
        diff = max(float((x - y).abs().nan_to_num(0.0).max()) for x, y in zip(got, want, strict=True))
        row: dict[str, Any] = {"flat": select.FLAT, "tile": select.TILE, "num_warps": 4, **way, "max_diff": diff}
        if cuda:
            for _ in range(10):
                run(way)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):  # (each launch's two outputs allocated from torch's cache: no sync)
                run(way)
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / args.reps
            row.update(
                us=round(us, 1), gbps=round(digest_bytes / us / 1e3, 1), ms_per_step=round(us * SPARSE_LAYERS / 1e3, 2)
            )
        table.append(row)
    card = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    print(f"`python -m h3d.bench.scores --batch {b} --context {w * bs}` ({time.strftime('%Y-%m-%d')}, {card}; "
          f"{b} sessions x {hkv} KV heads x {w} blocks x {parts} parts, "
          f"{digest_bytes / 1e6:.1f} MB of digests a launch)")  # fmt: skip
    print()
    print("| flat | tile | warps | µs a launch | GB/s | ms a step (30 layers) | max diff |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['flat']} | {r['tile']} | {r['num_warps']} | {r.get('us', '')} | {r.get('gbps', '')} | "
              f"{r.get('ms_per_step', '')} | {r['max_diff']:.2e} |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"card": card, "batch": b, "blocks": w, "ways": table}, indent=1))
    bad = [r for r in table if not r["max_diff"] <= 1e-3 * max(1.0, float(want[0].abs().nan_to_num(0.0).max()))]
    if bad:
        print(f"h3d.bench.scores: {len(bad)} way(s) disagree with the defaults", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
