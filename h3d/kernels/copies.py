"""Moving K/V rows and blocks where they live: `paged_write` (new tokens' K/V into HBM or into the
pinned DDR slab, in place, one launch) and `copy_blocks` (whole blocks between pools, one launch),
each with its torch twin that the CPU runs; the tests run the kernels under `TRITON_INTERPRET=1`.
A pinned DDR slab is read or written over PCIe in place, as `h3d.kernels.decode` reads it (its
docstring: "The DDR slab").
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from h3d.kernels import loader

# Bound by `_kernels()` at the first launch (the kernels below refer to `tl` as a global).
triton: Any = None
tl: Any = None


def to_device(x: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host array on `device`, queued behind the device's work rather than waiting for
    it: torch's blocking copy from host memory synchronizes the stream (every kernel queued
    before it done first), which in a loop over layers makes each layer a round trip between
    host and device. On CUDA it is copied into pinned memory first (so the caller may change
    `x` at once; torch's pinned allocator keeps that buffer until the copy has run), then
    without blocking. Elsewhere `x` as a tensor on `device` (no copy on the CPU). Never inside
    a CUDA graph's capture (the copy would be baked into the graph)."""
    t = torch.from_numpy(x) if isinstance(x, np.ndarray) else x
    if device.type != "cuda":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():  # (a blocking copy would fail there: so must this)
        raise RuntimeError("a host array copied to the device inside a CUDA graph's capture")
    return t.pin_memory().to(device, non_blocking=True)


@cache
def _kernels() -> SimpleNamespace:
    """Decorate the write and copy kernels, once."""
    return loader.jit(globals(), write=_write_kernel, copy=_copy_kernel)


def paged_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
) -> None:
    """Store new tokens' K/V where their blocks live, in one launch: k, v [N, Hkv, D]; rows [N]
    int64 on k's device, a pool row (slot * bs + offset) of HBM (>= 0) or -(DDR row + 1) of the
    pinned DDR slab, written in place over PCIe (so that a step captured in a CUDA graph needs no
    host copy). Without Triton (the CPU), two `index_copy_`s."""
    if loader.runs_on(k.device):
        kernels = _kernels()
        n, hkv, d = k.shape
        hbm_k, ddr_k = (loader.addressable(p, k.device) for p in k_pools)
        hbm_v, ddr_v = (loader.addressable(p, k.device) for p in v_pools)
        if hbm_k.stride() != hbm_v.stride() or ddr_k.stride() != ddr_v.stride():
            raise ValueError("paged_write: the K and V slabs of a tier must share their layout")
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("paged_write: k and v rows must be contiguous")
        if not rows.is_contiguous():
            raise ValueError("paged_write: rows must be contiguous")
        kernels.write[(n, hkv)](
            k, v, hbm_k, hbm_v, ddr_k, ddr_v, rows,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), hbm_k.stride(0), ddr_k.stride(0),
            D=d, D_PAD=triton.next_power_of_2(d), num_warps=1,
        )  # fmt: skip
        return
    in_hbm = rows >= 0
    for pools, x in ((k_pools, k), (v_pools, v)):
        for pool, sel, r in ((pools[0], in_hbm, rows), (pools[1], ~in_hbm, -rows - 1)):
            idx = torch.nonzero(sel).flatten()
            if len(idx):
                flat = pool.view(pool.shape[0], -1, pool.shape[-1])
                flat.index_copy_(1, r[idx].to(pool.device), x[idx].transpose(0, 1).to(pool.device, pool.dtype))


def copy_blocks(
    src: tuple[torch.Tensor, torch.Tensor],
    src_slots: torch.Tensor,
    dst: tuple[torch.Tensor, torch.Tensor],
    dst_slots: torch.Tensor,
) -> None:
    """Copy whole blocks between pools: (K, V) slabs [Hkv, S, bs, D] of `src` at `src_slots` [n] into
    `dst`'s at `dst_slots` [n]. On CUDA one kernel launch, each program reading a block of one KV
    head where it lives (HBM, or the pinned DDR slab over PCIe) and writing it where it goes: no
    gather on the host and no staging copy. Without Triton (the CPU), an index copy per pool."""
    device = src_slots.device
    if loader.runs_on(device):
        if not len(src_slots):
            return
        kernels = _kernels()
        sk, sv = (loader.addressable(p, device) for p in src)
        dk, dv = (loader.addressable(p, device) for p in dst)
        if sk.stride() != sv.stride() or dk.stride() != dv.stride():
            raise ValueError("copy_blocks: the K and V slabs of a pool must share their layout")
        hkv, _, bs, d = sk.shape
        kernels.copy[(len(src_slots), hkv)](
            sk, sv, dk, dv, src_slots.contiguous(), dst_slots.contiguous(), sk.stride(0), dk.stride(0),
            N=bs * d, N_PAD=triton.next_power_of_2(bs * d), num_warps=4,
        )  # fmt: skip
        return
    for a, b in zip(src, dst, strict=True):
        b[:, dst_slots.to(b.device)] = a[:, src_slots.to(a.device)].to(b.device, b.dtype)


# The kernels, as plain functions: `_kernels()` decorates them with `triton.jit` at the first launch.


def _write_kernel(  # type: ignore[no-untyped-def]
    k, v, hbm_k, hbm_v, ddr_k, ddr_v, rows,
    k_stride_n, k_stride_h, v_stride_n, v_stride_h, hbm_stride_h, ddr_stride_h,
    D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    """Program (n, kh): token n's K and V of KV head kh to its row, in HBM or in pinned DDR.
    Offsets in int64: a head's slab alone can pass 2**31 elements (128K tokens of an 8B model)."""
    n = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    row = tl.load(rows + n)
    d = tl.arange(0, D_PAD)
    inside = d < D
    kx = tl.load(k + n * k_stride_n + kh * k_stride_h + d, mask=inside)
    vx = tl.load(v + n * v_stride_n + kh * v_stride_h + d, mask=inside)
    in_hbm = row >= 0
    hbm_at = kh * hbm_stride_h + tl.where(in_hbm, row, 0) * D + d
    ddr_at = kh * ddr_stride_h + tl.where(in_hbm, 0, -row - 1) * D + d
    tl.store(hbm_k + hbm_at, kx.to(hbm_k.dtype.element_ty), mask=inside & in_hbm)
    tl.store(hbm_v + hbm_at, vx.to(hbm_v.dtype.element_ty), mask=inside & in_hbm)
    tl.store(ddr_k + ddr_at, kx.to(ddr_k.dtype.element_ty), mask=inside & ~in_hbm)
    tl.store(ddr_v + ddr_at, vx.to(ddr_v.dtype.element_ty), mask=inside & ~in_hbm)


def _copy_kernel(  # type: ignore[no-untyped-def]
    sk, sv, dk, dv, src_slots, dst_slots, src_stride_h, dst_stride_h, N: tl.constexpr, N_PAD: tl.constexpr,
):  # fmt: skip
    """Program (i, kh): block i's K and V tiles of KV head kh, from slot src_slots[i] to dst_slots[i]."""
    i = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    a = tl.load(src_slots + i)
    b = tl.load(dst_slots + i)
    e = tl.arange(0, N_PAD)
    inside = e < N
    at_src = kh * src_stride_h + a * N + e
    at_dst = kh * dst_stride_h + b * N + e
    tl.store(dk + at_dst, tl.load(sk + at_src, mask=inside).to(dk.dtype.element_ty), mask=inside)
    tl.store(dv + at_dst, tl.load(sv + at_src, mask=inside).to(dv.dtype.element_ty), mask=inside)
