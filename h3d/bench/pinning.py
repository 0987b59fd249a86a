"""Where pinning DDR's time goes: host memory registered with CUDA (`cudaHostRegister`) in 4 GiB
pieces, on one thread or several, its pages fresh or first zeroed on torch's CPU threads (what
`h3d.kv.pool` does for a pinned slab).

    python -m h3d.bench.pinning [--gib 16]      # a CUDA host
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from h3d.kv.pool import PAGE, PIN_PIECE


def register(t: torch.Tensor, threads: int) -> float:
    """Seconds to register `t` in pieces on `threads` threads (then unregistered)."""
    base, size = t.data_ptr(), t.numel() * t.element_size()
    cuts = [base, *((base + at) & ~(PAGE - 1) for at in range(PIN_PIECE, size, PIN_PIECE)), base + size]
    pieces = list(itertools.pairwise(cuts))
    cudart = torch.cuda.cudart()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        errors = list(pool.map(lambda p: int(cudart.cudaHostRegister(p[0], p[1] - p[0], 3)), pieces))
    took = time.perf_counter() - t0
    for ptr, _ in pieces:
        cudart.cudaHostUnregister(ptr)
    if any(errors):
        raise SystemExit(f"cudaHostRegister failed: {errors}")
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.pinning", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=int, default=16, help="GiB of host memory registered each time")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("h3d.bench.pinning: needs a CUDA device")
    torch.cuda.init()
    for label, touch, threads in (("fresh, 1 thread", False, 1), ("fresh, 8 threads", False, 8),
                                  ("touched, 8 threads", True, 8)):  # fmt: skip
        t = torch.empty(args.gib << 30, dtype=torch.uint8)
        touched = 0.0
        if touch:
            t0 = time.perf_counter()
            t.zero_()
            touched = time.perf_counter() - t0
        took = register(t, threads)
        print(f"{label}: {args.gib} GiB registered in {took:.2f} s (touch {touched:.2f} s, "
              f"torch threads {torch.get_num_threads()})", flush=True)  # fmt: skip
        del t
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
