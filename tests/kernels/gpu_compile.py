"""Compile every Triton kernel the GPU path launches, for a CUDA target, on a host without a GPU.

    python tests/kernels/gpu_compile.py [--arch 90] [--sms 132] [--shapes llama3-8b gemma3-12b smollm2-135m]

The interpreter that the kernel tests run (`TRITON_INTERPRET=1`) executes a kernel's Python
body; it never hands the kernel to Triton's compiler, which refuses some code the interpreter
takes (a name given two shapes across a runtime `if`, for one). This script runs in a process
without the interpreter, with Triton's active driver replaced by one that names a CUDA target
(no device is opened), and each launch turned into a compile only (`warmup`): every wrapper of
`h3d.kernels` is called at the shapes of the named models, in bf16 (the first in fp16 too), as a
step calls it (the decode kernels through `warm_decode`, every variant a decode of up to 128K
tokens compiles; the digest scores in each way `python -m h3d.bench.scores` times at the first
shape, their defaults at the others), and each launch is compiled to a cubin by Triton's own
ptxas. Prints one line per variant compiled (or loaded from Triton's cache); exits 1 on the
first kernel that does not compile, with Triton's message.
`tests/kernels/test_gpu_compile.py` runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # before Triton is imported: its compiler, not its interpreter

import torch


@dataclass(frozen=True)
class Shape:
    kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    hidden: int


SHAPES = {
    "llama3-8b": Shape(8, 4, 128, 4096),
    "gemma3-12b": Shape(8, 2, 256, 3840),
    "smollm2-135m": Shape(3, 3, 64, 576),  # the embedded model
}
BLOCK_SIZE = 32  # the engine's default
MAX_TOKENS = 131072


class _CompileOnlyDriver:
    """Triton's active driver as far as compiling goes: a CUDA target, device 0, no stream."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def compile_only(arch: int, sms: int) -> list[tuple[str, float | None]]:
    """From now on each kernel launch compiles its variant for `arch` and launches nothing;
    the wrappers take the kernels' path for CPU tensors and split decode work as for a device
    of `sms` SMs. Returns the list each launch is appended to (kernel name, seconds; None where
    the launch met a variant compiled before in this process)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from h3d.kernels import decode, loader

    driver.set_active(_CompileOnlyDriver(arch))
    compiled: list[tuple[str, float]] = []
    run = JITFunction.run

    def compile_instead(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        t0, before = time.perf_counter(), loader.COMPILES.count
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        new = loader.COMPILES.count > before  # (Triton's hook: compiled, or loaded from its cache)
        compiled.append((self.fn.__name__, time.perf_counter() - t0 if new else None))
        return kernel

    JITFunction.run = compile_instead  # type: ignore[method-assign]
    loader.runs_on = lambda device: True  # type: ignore[assignment]
    decode._sm_count = lambda device: sms  # type: ignore[assignment]
    return compiled


def launch_all(shape: Shape, ways: list[dict[str, Any]], dt: torch.dtype = torch.bfloat16) -> None:
    """Every wrapper of `h3d.kernels` once per variant a step at `shape` launches (outputs unused)."""
    from h3d.kernels import copies, decode, fused, probe, select

    bs, hkv, d = BLOCK_SIZE, shape.kv_heads, shape.head_dim
    h = hkv * shape.group
    pool = torch.zeros(hkv, 4, bs, d, dtype=dt)
    q = torch.zeros(1, h, d, dtype=dt)
    decode.warm_decode(q, (pool, pool), (pool, pool), MAX_TOKENS // bs + 1, head=True)
    n = 4
    k = torch.zeros(n, hkv, d, dtype=dt)
    copies.paged_write(k, k, (pool, pool), (pool, pool), torch.zeros(n, dtype=torch.int64))
    slots = torch.zeros(2, dtype=torch.int64)
    copies.copy_blocks((pool, pool), slots, (pool, pool), slots)
    x = torch.zeros(n, shape.hidden, dtype=dt)
    fused.add_rms_norm(x, x, torch.ones(shape.hidden, dtype=dt), 1e-6)
    cos = torch.zeros(n, d, dtype=torch.float32)
    fused.rotary(torch.zeros(n, h, d, dtype=dt), cos, cos)
    # the prompt probe: the cached prefix's keys (a view of the pool) and the chunk's own
    prefix, own = pool[:, :3].flatten(1, 2), k.transpose(0, 1)
    probe.key_mass(torch.zeros(hkv, 64 * shape.group, d), [prefix, own], 64, shape.group)

    b, w, parts, anchors = 16, 1024, 4, 8
    i64 = dict(dtype=torch.int64)
    arena = torch.zeros(hkv, b * w * parts + 1, 2, d, dtype=dt)
    out = torch.zeros(b, hkv, w)
    base, nb = torch.zeros(b, **i64), torch.full((b,), w, **i64)
    live, take = nb * parts, torch.zeros(b, **i64)
    anchor = torch.zeros(b, hkv, anchors, **i64)
    qb = torch.zeros(b, h, d, dtype=dt)
    for way in ways:
        for raw in (None, out.clone()):
            select.scores(out, qb, arena, parts, base, nb, live, take, anchor, 1, 2, raw=raw, **way)
    room = torch.full((b,), 64, **i64)
    top = select.top_room(out, room, 64)
    table = torch.zeros(b, w, dtype=torch.int32)
    heads = torch.zeros(b, hkv, w, dtype=torch.int32)
    picked = torch.zeros(b, hkv, 1 + 64 + 2, **i64)
    select.lists(top, table, nb, room, heads, torch.zeros(b, hkv, dtype=torch.int32), picked, 1, 2)
    select.fold(arena, torch.zeros(b, **i64), torch.zeros(b, hkv, d, dtype=dt))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="the CUDA compute capability, x10 (90: H100, H200)")
    p.add_argument("--sms", type=int, default=132, help="the device's SMs (the decode's splits; 132: H100, H200)")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = p.parse_args(argv)
    compiled = compile_only(args.arch, args.sms)
    from h3d.bench.scores import WAYS

    # every way at the first shape, the defaults at the others; the first again in fp16
    runs = [(name, WAYS if i == 0 else [{}], torch.bfloat16) for i, name in enumerate(args.shapes)]
    runs.append((args.shapes[0], [{}], torch.float16))
    for name, ways, dt in runs:
        done, label = len(compiled), f"{name} {str(dt).removeprefix('torch.')}"
        try:
            launch_all(SHAPES[name], ways, dt)
        except Exception:
            print(f"{label}: a kernel did not compile for sm_{args.arch}:", file=sys.stderr)
            traceback.print_exc()
            return 1
        for kernel, seconds in compiled[done:]:
            if seconds is not None:
                print(f"{label}: {kernel} compiled in {seconds:.2f} s")
    from h3d.kernels.loader import COMPILES

    variants = f"{COMPILES.count} variants compiled for sm_{args.arch} in {COMPILES.seconds:.1f} s"
    print(f"{len(compiled)} launches, {variants}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
