"""Where pinning DDR's time goes: a pool's K and V slabs registered with CUDA by `h3d.kv.pool.Pinning`
(pages zeroed then `cudaHostRegister`ed in pieces, lowest slots first, on several threads), timed
to the first slots usable (what a start waits for) and to all of them (what goes on after ready).

    python -m h3d.bench.pinning [--gib 16] [--threads 8 16]      # a CUDA host
"""

from __future__ import annotations

import argparse
import time

import torch

from h3d.kv.pool import Pinning

HEADS, BLOCK, DIM = 8, 32, 128  # Llama-3-8B's KV heads and head size, h3d's default block


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.pinning", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=int, default=16, help="GiB of host memory (K and V together)")
    p.add_argument("--threads", type=int, nargs="+", default=[8], help="registering threads, one run each")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("h3d.bench.pinning: needs a CUDA device")
    torch.cuda.init()
    slots = (args.gib << 30) // (2 * HEADS * BLOCK * DIM * 2)
    for threads in args.threads:
        t0 = time.perf_counter()
        k = torch.empty(HEADS, slots, BLOCK, DIM, dtype=torch.bfloat16)
        v = torch.empty_like(k)
        pinning = Pinning([k, v], threads=threads)
        first, usable = time.perf_counter() - t0, pinning.usable
        pinning.wait(slots)
        took = time.perf_counter() - t0
        print(f"{args.gib} GiB on {threads} threads: {usable / slots:.1%} of the slots usable after {first:.2f} s, "
              f"all after {took:.2f} s ({args.gib / took:.1f} GiB/s){'; ' + pinning.error if pinning.error else ''}",
              flush=True)  # fmt: skip
        pinning.close()
        del k, v
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
