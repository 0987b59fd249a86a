"""How fast the decode kernel reads pinned DDR in place, by how the pool's pages were made and in
what order they are read: what a step that reads part of its selection from DDR can reach on
this host.

    python -m h3d.bench.ddr_reads [--gib 16] [--batch 16] [--picks 64] [--layers 32]   # a CUDA host

A `many` step of 16 sessions at 32K reads about 2.2 GB a step from pinned DDR in place (the
blocks of its selections that are not in HBM): per layer, per session and KV head, some tens of
`block x head_dim` tiles scattered over a pool of tens of GB. The copy engine's bandwidth
(`h2d`) is what the floor of a step assumes for those bytes; this probe measures what
`h3d.kernels.decode.paged_decode` gets instead, on the same bytes:

- pools: `plain` (the daemon's DDR pool, `KVPool`, with `ddr_memory = registered`: pageable
  memory registered in pieces by `h3d.kv.pool.Pinning`), `vmm` (the same with `ddr_memory =
  mapped`: the driver's pinned pages mapped piece by piece into one range, `h3d.kv.hostmem`),
  `hugepages` (registered, with `madvise(MADV_HUGEPAGE)` before its pages are faulted in),
  `hostalloc` (one `cudaHostAlloc`), and, on a host of several NUMA nodes, `plain` with its pages
  faulted in on each node (`node<N>`);
- reads, `--layers` tables each (one per layer, as a step reads them): `scattered` (each
  (session, KV head) list `--picks` random slots of the whole pool), `runs` (the same count of
  consecutive slots from a random start), `mixed` (four fifths of each list scattered over an HBM
  pool, a fifth over DDR: a step's hit rate of 0.8);
- the copy engine on the same pool (`h2d`, 64 MiB contiguous) and `copy_blocks` of scattered whole
  blocks into HBM (a promotion's copy).

Also printed: the host's transparent huge page setting, NUMA nodes, the GPU's node, IOMMU groups.
Each figure is the median of `--reps` timed passes after one untimed; GB/s are the bytes the
kernel reads (K and V) over the pass's time.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from h3d.bench.gpu_base import median_s
from h3d.kv.pool import KVPool, Pinning

HEADS, QHEADS, BLOCK, DIM = 8, 32, 32, 128  # Llama-3-8B's KV and query heads, h3d's default block
MADV_HUGEPAGE = 14
H2D_BYTES = 64 << 20  # the copy engine's figure: this many bytes from a pool's start (within its first piece)


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def _meminfo_kb(key: str) -> int:
    for line in _read("/proc/meminfo").splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _nodes() -> dict[int, list[int]]:
    """NUMA node -> its CPUs that this process may run on."""
    out: dict[int, list[int]] = {}
    allowed = os.sched_getaffinity(0)
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus: list[int] = []
        for part in _read(str(d / "cpulist")).split(","):
            if "-" in part:
                a, b = part.split("-")
                cpus += range(int(a), int(b) + 1)
            elif part.strip().isdigit():
                cpus.append(int(part))
        cpus = [c for c in cpus if c in allowed]
        if cpus:
            out[int(d.name[4:])] = cpus
    return out


def host_facts(device: torch.device) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(device)
    ids = [int(getattr(props, f"pci_{x}_id", 0)) for x in ("domain", "bus", "device")]
    bus = f"{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0"
    groups = Path("/sys/kernel/iommu_groups")
    return {
        "gpu": props.name,
        "gpu_pci": bus,
        "gpu_numa_node": _read(f"/sys/bus/pci/devices/{bus}/numa_node"),
        "gpu_link": [_read(f"/sys/bus/pci/devices/{bus}/current_link_{x}") for x in ("speed", "width")],
        "numa_nodes": {n: len(c) for n, c in _nodes().items()},
        "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
        "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
        "iommu_groups": len(list(groups.iterdir())) if groups.is_dir() else 0,
        "cmdline_iommu": [t for t in _read("/proc/cmdline").split() if "iommu" in t],
        "cpus": len(os.sched_getaffinity(0)),
    }


def _madvise_huge(t: torch.Tensor) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = (t.data_ptr() + (2 << 20) - 1) & ~((2 << 20) - 1)
    end = (t.data_ptr() + t.numel() * t.element_size()) & ~((2 << 20) - 1)
    return int(libc.madvise(start, max(0, end - start), MADV_HUGEPAGE)) if end > start else -1


class Pool:
    """K and V host slabs [HEADS, slots, BLOCK, DIM] made one of the probe's ways."""

    def __init__(self, kind: str, slots: int, cpus: list[int] | None = None) -> None:
        self.kind, self.pinning = kind, None
        self.pool: KVPool | None = None
        before, mask = _meminfo_kb("AnonHugePages"), os.sched_getaffinity(0)
        t0 = time.perf_counter()
        if cpus:
            os.sched_setaffinity(0, cpus)  # Pinning's threads (started below) inherit it
        try:
            if kind in ("vmm", "plain"):  # the daemon's DDR pool, mapped (`h3d.kv.hostmem`) or registered
                memory = "mapped" if kind == "vmm" else "registered"
                self.pool = KVPool(slots, BLOCK, HEADS, DIM, torch.bfloat16, torch.device("cpu"), pin_memory=True,
                                   host_memory=memory)  # fmt: skip
                self.k, self.v, self.pinning = self.pool.k, self.pool.v, self.pool.pinning
                if self.pinning is not None:
                    self.pinning.wait(slots)
                    if self.pinning.error:
                        raise RuntimeError(self.pinning.error)
            elif kind == "hostalloc":
                self.k = torch.empty(HEADS, slots, BLOCK, DIM, dtype=torch.bfloat16, pin_memory=True)
                self.v = torch.empty_like(self.k, pin_memory=True)
            else:  # registered, with huge pages asked for first
                self.k = torch.empty(HEADS, slots, BLOCK, DIM, dtype=torch.bfloat16)
                self.v = torch.empty_like(self.k)
                for t in (self.k, self.v):
                    _madvise_huge(t)
                self.pinning = Pinning([self.k, self.v])
                self.pinning.wait(slots)
                if self.pinning.error:
                    raise RuntimeError(self.pinning.error)
        finally:
            os.sched_setaffinity(0, mask)
        self.made_s = time.perf_counter() - t0
        self.huge_gb = (_meminfo_kb("AnonHugePages") - before) / 2**20

    def close(self) -> None:
        if self.pinning is not None:
            self.pinning.close()
        del self.k, self.v  # (a mapped pool is unmapped once no tensor over it is left)
        self.pool = None


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of fn() over `reps` passes after one untimed (CUDA events)."""
    return median_s(fn, reps, cuda=True, warm=1)


def _tables(
    pattern: str, layers: int, batch: int, picks: int, slots: int, hbm_slots: int, g: torch.Generator
) -> list[torch.Tensor]:
    """One [batch, HEADS, picks] int32 table of locations per layer (DDR slot s is -(s + 1))."""
    out = []
    for _ in range(layers):
        if pattern == "runs":
            start = torch.randint(1, slots - picks, (batch, HEADS, 1), generator=g)
            ddr = start + torch.arange(picks)
        else:
            ddr = torch.randint(1, slots, (batch, HEADS, picks), generator=g)
        loc = -(ddr + 1)
        if pattern == "mixed":
            hbm = torch.randint(1, hbm_slots, (batch, HEADS, picks), generator=g)
            loc = torch.where(torch.arange(picks) % 5 == 4, loc, hbm)
        out.append(loc.to(torch.int32).cuda())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.ddr_reads", description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=int, default=16, help="GiB of each DDR pool (K and V together)")
    p.add_argument("--hbm-gib", type=int, default=8, help="GiB of the HBM pool that `mixed` reads")
    p.add_argument("--batch", type=int, default=16, help="sessions in a step")
    p.add_argument("--picks", type=int, default=64, help="blocks each (session, KV head) list reads a layer")
    p.add_argument("--layers", type=int, default=32, help="tables in a timed pass (one per layer)")
    p.add_argument("--reps", type=int, default=5, help="timed passes per figure (the median is kept)")
    p.add_argument("--pools", nargs="+", default=["plain", "vmm", "hostalloc", "hugepages", "nodes"],
                   help="pools to make: plain, vmm, hostalloc, hugepages, nodes (plain on each NUMA node)")  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("h3d.bench.ddr_reads: needs a CUDA device")
    from h3d.kernels.copies import copy_blocks
    from h3d.kernels.decode import paged_decode

    dev = torch.device("cuda")
    torch.cuda.init()
    res: dict[str, Any] = {"host": host_facts(dev), "args": {k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(res["host"]), flush=True)
    tile = BLOCK * DIM * 2  # one (block, head)'s K bytes (bf16)
    slots = (args.gib << 30) // (2 * HEADS * tile)
    hbm_slots = (args.hbm_gib << 30) // (2 * HEADS * tile)
    hk = torch.zeros(HEADS, hbm_slots, BLOCK, DIM, dtype=torch.bfloat16, device=dev)
    hv = torch.zeros_like(hk)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(args.batch, QHEADS, DIM, dtype=torch.bfloat16, device=dev)
    nblocks = torch.full((args.batch, HEADS), args.picks, dtype=torch.int32, device=dev)
    tail = torch.full((args.batch,), BLOCK, dtype=torch.int32, device=dev)
    per_layer = args.batch * HEADS * args.picks * 2 * tile  # bytes a layer's kernel reads
    copy_n = min(slots - 1, args.batch * args.picks)
    dst = torch.arange(1, copy_n + 1, device=dev)

    def attend(pool: Pool, tables: list[torch.Tensor]) -> float:
        def run() -> None:
            for t in tables:
                paged_decode(q, (hk, pool.k), (hv, pool.v), t, nblocks, tail, 0.088)

        return _time(run, args.reps)

    def measure(pool: Pool) -> dict[str, Any]:
        row: dict[str, Any] = {"made_s": round(pool.made_s, 2), "huge_gb": round(pool.huge_gb, 2)}
        for pattern in ("scattered", "runs", "mixed"):
            tables = _tables(pattern, args.layers, args.batch, args.picks, slots, hbm_slots, g)
            row[f"{pattern}_gbps"] = round(args.layers * per_layer / attend(pool, tables) / 1e9, 1)
        # (a copy must not span two of `Pinning`'s registered pieces: CUDA refuses it)
        chunk = pool.k.view(-1)[: H2D_BYTES // 2]
        to = torch.empty(chunk.shape, dtype=chunk.dtype, device=dev)
        row["h2d_gbps"] = round(H2D_BYTES / _time(lambda: to.copy_(chunk, non_blocking=True), args.reps) / 1e9, 1)
        src = torch.randint(1, slots, (copy_n,), generator=g).to(dev)
        secs = _time(lambda: copy_blocks((pool.k, pool.v), src, (hk, hv), dst), args.reps)
        row["copy_blocks_gbps"] = round(copy_n * 2 * HEADS * tile / secs / 1e9, 1)
        return row

    hbm_tables = [t.neg() - 1 for t in _tables("scattered", args.layers, args.batch, args.picks, hbm_slots,
                                              hbm_slots, g)]  # fmt: skip
    kinds: list[tuple[str, list[int] | None]] = []
    for kind in args.pools:
        if kind == "nodes":
            nodes = _nodes()
            kinds += [(f"node{n}", cpus) for n, cpus in nodes.items()] if len(nodes) > 1 else []
        else:
            kinds.append((kind, None))
    res["pools"] = {}
    first = True
    for name, cpus in kinds:
        try:
            pool = Pool(name if name in ("hostalloc", "hugepages", "vmm") else "plain", slots, cpus)
        except RuntimeError as e:
            res["pools"][name] = {"error": str(e)}
            print(f"{name}: {e}", flush=True)
            continue
        if first:  # the HBM pool read the same way, once
            res["hbm_scattered_gbps"] = round(args.layers * per_layer / attend(pool, hbm_tables) / 1e9, 1)
            print(f"hbm scattered: {res['hbm_scattered_gbps']} GB/s", flush=True)
            first = False
        row = measure(pool)
        res["pools"][name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
        pool.close()
        del pool
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
