"""Archive read bandwidth: how fast `Mover.read` brings archived KV back into a DDR pool.

    python -m h3d.bench.archive_read [--records 32768] [--threads 1 4 8 16] [--run-bytes 0 4194304]
                                     [--first-step] [--work DIR]

Writes `--records` records of one bf16 KV block each (8 KV heads x 32 tokens x 128, the shape of
a Llama-3-8B block: 128 KiB) of 32 layers with `Archive.put` on 8 threads, then reads them back
into a host pool with `Mover.read` on each thread count and each `--run-bytes` (the longest
pread of neighbouring records, `h3d.tiers.archive.READ_RUN_BYTES`; 0: one pread a record), cold
(the segments' pages dropped from the page cache with posix_fadvise DONTNEED) and warm: all of
them, or with `--first-step` what a first decode step after a restart reads (layers 0 and 1
whole, a fifth of the other layers' blocks at random). Prints one line per read; the folder is
removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from h3d.kv.pool import KVPool
from h3d.tiers import archive as archive_mod
from h3d.tiers import mover
from h3d.tiers.archive import Archive
from h3d.tiers.identity import BlockKey, CacheIdentity

HEADS, TOKENS, DIM = 8, 32, 128


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.archive_read", description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=32768, help="records written and read back (128 KiB of KV each)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16], help="reader thread counts to time")
    p.add_argument("--run-bytes", type=int, nargs="+", default=[archive_mod.READ_RUN_BYTES],
                   help="the longest pread of neighbouring records, each timed (0: one pread a record)")  # fmt: skip
    p.add_argument("--first-step", action="store_true",
                   help="read what a first step reads: layers 0 and 1 whole, a fifth of the rest")  # fmt: skip
    p.add_argument("--work", type=Path, default=Path(".bench/archive-read"), help="the archive's folder (removed)")
    args = p.parse_args(argv)
    shutil.rmtree(args.work, ignore_errors=True)
    n = args.records
    ident = CacheIdentity("f" * 64, "bf16", TOKENS, HEADS, DIM)
    archive = Archive(args.work / "archive", ident)
    # The settings timed are the modules' own: set for each read, put back when the probe ends
    # (a caller in the same process, a test, keeps the defaults).
    saved = mover.READ_THREADS, archive_mod.READ_RUN_BYTES
    try:
        base = (torch.randn(HEADS, 2 * TOKENS, DIM, generator=torch.Generator().manual_seed(0)) * 2).to(torch.bfloat16)
        keys = [BlockKey("s", i % 32, i // 32) for i in range(n)]

        def put(lo: int) -> None:
            archive.put([(keys[i], base[:, i % 32 : i % 32 + TOKENS], base[:, 32 - i % 32 : 64 - i % 32])
                         for i in range(lo, min(lo + 128, n))])  # fmt: skip

        gb = n * 2 * HEADS * TOKENS * DIM * 2 / 1e9
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(put, range(0, n, 128)))
        took = time.perf_counter() - t0
        print(f"put {n} records ({gb:.2f} GB) on 8 threads: {took:.1f} s, {gb / took:.2f} GB/s; "
              f"on disk {archive.disk_bytes() / 1e9:.2f} GB", flush=True)  # fmt: skip
        if args.first_step:
            pick = np.random.default_rng(0).random(n) < 0.2
            keys = [key for key, p in zip(keys, pick, strict=True) if key.layer < 2 or p]
            gb *= len(keys) / n
        ddr = KVPool(len(keys) + 1, TOKENS, HEADS, DIM, torch.bfloat16, torch.device("cpu"))
        hbm = KVPool(2, TOKENS, HEADS, DIM, torch.bfloat16, torch.device("cpu"))
        slots = np.arange(1, len(keys) + 1)
        for run_bytes in args.run_bytes:
            archive_mod.READ_RUN_BYTES = run_bytes
            for threads in args.threads:
                mover.READ_THREADS = threads
                for kind in ("cold", "warm"):
                    if kind == "cold":
                        for path in (args.work / "archive").iterdir():
                            fd = os.open(path, os.O_RDONLY)
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                            os.close(fd)
                    m = mover.Mover(hbm, ddr, archive)
                    t0 = time.perf_counter()
                    m.read(keys, slots)
                    took = time.perf_counter() - t0
                    m.close()
                    print(f"read {len(keys)} records, runs of {run_bytes >> 10} KiB, {threads:2d} threads {kind}: "
                          f"{took:.2f} s, {gb / took:.2f} GB/s", flush=True)  # fmt: skip
    finally:
        mover.READ_THREADS, archive_mod.READ_RUN_BYTES = saved
        archive.close()
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
