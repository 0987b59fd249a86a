"""Paged decode attention (one query token per sequence, blocks read where they live) and its
torch twin, `torch_paged_decode`, that the CPU runs; the tests run the kernels under
`TRITON_INTERPRET=1`.

`paged_decode(q, k_pools, v_pools, tables, nblocks, tail, scale)` attends each sequence's query
heads to the blocks listed for each of its KV heads: `tables[b, kh, :nblocks[b, kh]]` holds block
locations (HBM slot `s >= 0`, or `-(DDR slot + 1)`), a selection in any order or every block, each
list ending with the sequence's last, partial block (`tail[b]` valid tokens; every other listed
block has `bs`). With `head`, the first `head[b]` tokens of each list's first entry are not read
either: a sliding-window layer's window, listed as its blocks, starts inside the first one. Pool
slabs are `[Hkv, slots, bs, D]` (`h3d.kv.pool.KVPool`): for a (block, head) the `bs x D` tile is
contiguous, so each key row is one coalesced `D`-element load.

Grid and work (flash-decoding):

- `_split_kernel`, grid `(B, Hkv, splits)`. Program (b, kh, s) takes entries
  `[s * block_split, (s + 1) * block_split)` of list (b, kh) and walks them `CHUNK` blocks at a time
  (a `TILE = CHUNK * bs >= 64`-token tile): it loads the tile's locations, picks for each key row a
  pointer into the HBM or the DDR slab by the location's sign (a pointer select: one load per row,
  no second masked load), and runs an online softmax in fp32 (base 2, `scale * log2 e` folded in).
  GQA: the program serves all `G = H / Hkv` query heads of its KV head at once, a `[G_PAD, D]` query
  tile (`G_PAD = max(16, next pow2 of G)`, padded rows masked: `tl.dot` wants every dim >= 16)
  against a `[TILE, D]` key tile, so K/V are read once per KV head, never repeated. Both products
  are `tl.dot`s with fp32 accumulation (`ieee` precision for fp32 pools, no tf32).
  Bytes read per program: `2 * block_split * bs * D * itemsize` of K/V (less for the tail's masked
  rows), `block_split * 4` of table, `G * D * itemsize` of query. It writes `G` partial rows of
  `D` fp32 and `G` log-sum-exps.
- `_merge_kernel`, grid `(B, H)`: merges the splits of one query head by log-sum-exp, reading
  `splits * (D + 1) * 4` bytes and writing `D` values in q's dtype. Splits that got no entry (lists
  shorter than the table width; their programs write zeros and lse = -inf) are not even read: the
  merge counts the used ones, `cdiv(nblocks, block_split)`.

Why two kernels: a split does not know when its siblings finish, and a merge inside the first
kernel would need a grid-wide barrier or atomics plus a "last program merges" counter (more state,
nondeterministic order). A second launch of `B * H` tiny programs costs a few microseconds, and is
skipped altogether when one split covers the table (the split kernel then writes the output).

Split heuristic (`block_split=None`), from shapes only (no device sync, so CUDA-graph friendly):
at most `4 * SMs` programs; `splits = (4 * SMs) // (B * Hkv)` (at least 1, and no more than one per
`CHUNK` blocks of the table width `W`); `block_split = cdiv(W, splits)` rounded up to a multiple of
`CHUNK`. A wide batch (B * Hkv >= 4 * SMs) gets one split and no merge; one long sequence gets many.
The cap of about 4 programs per SM is where a sweep of `block_split` read fastest: fewer programs
leave bandwidth unused, slightly more leave a partial last wave (docs/BENCHMARKS.md, "GPU: h3d
against transformers on the H200", the paged decode kernel alone).

The DDR slab: on CUDA it is a pinned host tensor, passed to the kernel as is. Triton's launcher
resolves each pointer argument with `cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`,
which succeeds for pinned (cudaHostAlloc'd) memory and, under unified addressing, gives the same
address: the kernel then reads those rows over PCIe (zero-copy). Pageable host memory is refused
here (`h3d.kernels.loader.addressable`) with a clear error (the GPU cannot address it). What must
stay true on a card: with pinned DDR slabs the outputs are within tolerance of the float64 oracle,
and a CUDA graph of a call replays to the same output; `python -m h3d.bench.gpu` checks it end to
end, its `exact_25pct` (75 % of the blocks read from pinned DDR) giving `exact_full`'s logits
(docs/BENCHMARKS.md, "GPU: h3d against transformers on the H200").

Fallback: the Triton kernels run on CUDA tensors, or on CPU tensors when `TRITON_INTERPRET=1`
(Triton's interpreter). Otherwise (CPU without the interpreter, or no Triton installed)
`torch_paged_decode` computes the same thing by gathering the listed blocks and a masked fp32
softmax. Triton is imported lazily, at the first launch (`h3d.kernels.loader`): the engine
core imports this module with torch alone, and importing it does not fix the interpreter mode
(TRITON_INTERPRET must be set before anything imports Triton: `h3d.kernels.loader`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

from h3d.kernels import loader

# Bound by `_kernels()` at the first launch (the kernels below refer to `tl` as a global).
triton: Any = None
tl: Any = None


# The arguments that follow a table's width, a batch or a split (`h3d.kernels.loader`): not
# specialized on, so that a step whose selection lists a width not seen before compiles nothing.
LOOSE = {
    "split": ("stride_tb", "stride_th", "stride_nb", "stride_nh", "stride_tail", "stride_head", "block_split"),
    "merge": ("stride_nb", "stride_nh", "block_split", "splits"),
}


@cache
def _kernels() -> SimpleNamespace:
    """Decorate the split and merge kernels, once."""
    return loader.jit(globals(), LOOSE, split=_split_kernel, merge=_merge_kernel)


BLOCK_SIZES = (16, 32, 64, 128)
HEAD_DIMS = (16, 32, 64, 128, 256)
MIN_TILE = 64  # key rows per loop step of a program: CHUNK = max(1, MIN_TILE // bs) blocks
PROGRAMS_PER_SM = 4  # the split heuristic's target (module docstring)


Alloc = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]  # (shape, dtype, device)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`paged_decode`'s default `alloc`: uninitialized memory (every byte read is written first)."""
    return torch.empty(shape, dtype=dtype, device=device)


def paged_decode(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
    scale: float,
    *,
    head: torch.Tensor | None = None,
    block_split: int | None = None,
    alloc: Alloc = _empty,
) -> torch.Tensor:
    """Decode attention over per-(sequence, KV head) block lists. See the module docstring.

    q: [B, H, D]; k_pools, v_pools: (HBM, DDR) slabs [Hkv, S_tier, bs, D]; tables: [B, Hkv, W]
    int32; nblocks: [B, Hkv] int32 (>= 1); tail: [B] int32 in 1..bs; head: [B] int32, below the
    first entry's valid tokens, or None (0) -> [B, H, D] in q's dtype.
    `alloc`: how the kernels' path allocates every buffer it writes (the output, the split
    workspace); the kernels write each byte they read, so one that fills them with NaN (a test)
    gives the same output.
    """
    _check(q, k_pools, v_pools, tables, nblocks, tail)
    if head is not None and head.shape != tail.shape:
        raise ValueError(f"paged_decode: head {tuple(head.shape)} does not match B={q.shape[0]}")
    if loader.runs_on(q.device):
        return _triton_paged_decode(q, k_pools, v_pools, tables, nblocks, tail, scale, block_split, alloc, head)
    return torch_paged_decode(q, k_pools, v_pools, tables, nblocks, tail, scale, head)


def _check(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
) -> None:
    b, h, d = q.shape
    hkv, _, bs, dk = k_pools[0].shape
    if bs not in BLOCK_SIZES or d not in HEAD_DIMS:
        raise ValueError(f"paged_decode: block size {bs} must be one of {BLOCK_SIZES}, head dim {d} of {HEAD_DIMS}")
    if dk != d or h % hkv:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} does not fit pools {tuple(k_pools[0].shape)}")
    for pool in (*k_pools, *v_pools):
        if pool.dim() != 4 or pool.shape[0] != hkv or pool.shape[2:] != (bs, d) or pool.dtype != k_pools[0].dtype:
            raise ValueError(f"paged_decode: pool {tuple(pool.shape)} {pool.dtype} differs from the HBM K slab")
    if tables.shape[:2] != (b, hkv) or nblocks.shape != (b, hkv) or tail.shape != (b,):
        raise ValueError(f"paged_decode: tables {tuple(tables.shape)}, nblocks, tail do not match B={b}, Hkv={hkv}")


# ---------------------------------------------------------------- torch path (CPU, or no Triton)


def torch_paged_decode(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
    scale: float,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `paged_decode`, in plain torch: gather the listed blocks, masked fp32 softmax."""
    b, h, d = q.shape
    hkv, _, bs, _ = k_pools[0].shape
    w = tables.shape[-1]
    dev = q.device
    entry = torch.arange(w, device=dev)  # [W]
    n = nblocks.to(dev, torch.int64)[..., None]  # [B, Hkv, 1]
    listed = entry < n  # [B, Hkv, W]; padding entries are replaced by slot 0 and never used
    loc = torch.where(listed, tables.to(dev, torch.int64), 0)
    last = entry == n - 1  # [B, Hkv, W]
    tok = torch.arange(bs, device=dev)
    valid_tok = torch.where(last[..., None], tok < tail.to(dev)[:, None, None, None], True)  # [B, Hkv, W, bs]
    if head is not None:  # the window's start inside the first entry
        first = (entry == 0)[None, None, :, None]
        valid_tok = valid_tok & ~(first & (tok < head.to(dev)[:, None, None, None]))
    valid = (listed[..., None] & valid_tok).reshape(b, hkv, w * bs)  # [B, Hkv, T]
    k = _gather(k_pools, loc).masked_fill(~valid[..., None], 0.0)  # [B, Hkv, T, D] fp32
    v = _gather(v_pools, loc).masked_fill(~valid[..., None], 0.0)
    qg = q.float().view(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,bktd->bkgt", qg, k) * scale  # [B, Hkv, G, T]
    scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,bktd->bkgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def _gather(pools: tuple[torch.Tensor, torch.Tensor], loc: torch.Tensor) -> torch.Tensor:
    """pools: (HBM, DDR) [Hkv, S, bs, D]; loc: [B, Hkv, W] -> [B, Hkv, W*bs, D] fp32 on loc's device."""
    hbm, ddr = pools
    b, hkv, w = loc.shape
    heads = torch.arange(hkv, device=loc.device)[None, :, None]  # [1, Hkv, 1]
    from_hbm = hbm[heads.to(hbm.device), loc.clamp(min=0).to(hbm.device)].float().to(loc.device)
    from_ddr = ddr[heads.to(ddr.device), (-loc - 1).clamp(min=0).to(ddr.device)].float().to(loc.device)
    g = torch.where((loc >= 0)[..., None, None], from_hbm, from_ddr)  # [B, Hkv, W, bs, D]
    return g.reshape(b, hkv, w * hbm.shape[2], hbm.shape[3])


# ---------------------------------------------------------------- Triton path


@cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    # The interpreter runs a grid's programs one after another: one "SM" (a step of one session
    # with two KV heads still splits in two, so the engine's tests run the merge too; the kernel's
    # own tests choose their splits).
    return 1


def warm_decode(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    max_width: int,
    head: bool = False,
) -> int:
    """Launch the kernels once for each variant a decode of up to `max_width` blocks compiles
    (`LOOSE`: the rest is the splits' power-of-two padding, one split or several, and `head`'s
    window start), at batch 1 (any batch's splits are among those), reading the pools' null slot.
    q: [1, H, D], as a step's. Returns the launches (each compiled before a step needs it)."""
    hkv, _, bs, _ = k_pools[0].shape
    chunk = max(1, MIN_TILE // bs)
    cap = max(1, PROGRAMS_PER_SM * _sm_count(q.device) // hkv)
    counts = [1] + [(1 << i) + 1 for i in range(cap.bit_length()) if (1 << i) + 1 <= cap]
    device = q.device
    launches = 0
    for splits in counts:
        w = min(chunk * splits, max(1, max_width))
        tables = torch.zeros(1, hkv, w, dtype=torch.int32, device=device)
        nblocks = torch.full((1, hkv), w, dtype=torch.int32, device=device)
        tail = torch.full((1,), bs, dtype=torch.int32, device=device)
        for start in (None, torch.zeros(1, dtype=torch.int32, device=device)) if head else (None,):
            paged_decode(q, k_pools, v_pools, tables, nblocks, tail, 1.0, head=start)
            launches += 1
        if w == max_width:
            break
    return launches


def choose_block_split(b: int, hkv: int, w: int, bs: int, device: torch.device) -> int:
    """Blocks per program for a [B, Hkv, W] table (see the module docstring's heuristic)."""
    chunk = max(1, MIN_TILE // bs)
    splits = max(1, min(PROGRAMS_PER_SM * _sm_count(device) // (b * hkv), -(-w // chunk)))
    per = -(-w // splits)
    return max(chunk, -(-per // chunk) * chunk)


def _triton_paged_decode(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor],
    v_pools: tuple[torch.Tensor, torch.Tensor],
    tables: torch.Tensor,
    nblocks: torch.Tensor,
    tail: torch.Tensor,
    scale: float,
    block_split: int | None,
    alloc: Alloc,
    head: torch.Tensor | None = None,
) -> torch.Tensor:
    kernels = _kernels()
    b, h, d = q.shape
    hkv, _, bs, _ = k_pools[0].shape
    w = tables.shape[-1]
    g = h // hkv
    k_hbm, k_ddr = (loader.addressable(p, q.device) for p in k_pools)
    v_hbm, v_ddr = (loader.addressable(p, q.device) for p in v_pools)
    if k_hbm.stride() != v_hbm.stride() or k_ddr.stride() != v_ddr.stride():
        raise ValueError("paged_decode: K and V slabs of a tier must share their layout")
    if any(t.device != q.device for t in (tables, nblocks, tail, tail if head is None else head)):
        raise ValueError("paged_decode: tables, nblocks, tail and head must be on q's device")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_split is None:
        block_split = choose_block_split(b, hkv, w, bs, q.device)
    if block_split < 1:
        raise ValueError(f"paged_decode: block_split must be >= 1, got {block_split}")
    splits = max(1, -(-w // block_split))
    chunk = max(1, MIN_TILE // bs)
    out = alloc((b, h, d), q.dtype, q.device)
    if splits > 1:
        part_o = alloc((b, h, splits, d), torch.float32, q.device)  # [B, H, S, D]
        part_lse = alloc((b, h, splits), torch.float32, q.device)  # [B, H, S] (log2)
    else:  # unused: the split kernel writes `out`
        part_o = part_lse = out
    big = d * chunk * bs >= 128 * 128
    kernels.split[(b, hkv, splits)](
        q, k_hbm, v_hbm, k_ddr, v_ddr, tables, nblocks, tail, tail if head is None else head, out, part_o, part_lse,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_hbm.stride(0), k_hbm.stride(1), k_ddr.stride(0), k_ddr.stride(1),
        tables.stride(0), tables.stride(1), tables.stride(2),
        nblocks.stride(0), nblocks.stride(1), tail.stride(0), 0 if head is None else head.stride(0),
        block_split,
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), BS=bs, D=d, CHUNK=chunk, SINGLE=splits == 1,
        HEAD=head is not None,
        PRECISION="ieee" if k_hbm.dtype == torch.float32 else "tf32", DOT=loader.dot_dtype(k_hbm.dtype),
        num_warps=8 if big else 4, num_stages=2 if big else 3,
    )  # fmt: skip
    if splits > 1:
        kernels.merge[(b, h)](
            part_o, part_lse, nblocks, out,
            nblocks.stride(0), nblocks.stride(1), block_split, splits,
            SPLITS_PAD=triton.next_power_of_2(splits), G=g, D=d,
            num_warps=4, num_stages=1,
        )  # fmt: skip
    return out


# The kernels, as plain functions: `_kernels()` decorates them with `triton.jit` at the first launch.


def _split_kernel(  # type: ignore[no-untyped-def]
    q_ptr, k_hbm, v_hbm, k_ddr, v_ddr, tables_ptr, nblocks_ptr, tail_ptr, head_ptr, out_ptr, part_o_ptr,
    part_lse_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_hbm_h, stride_hbm_s, stride_ddr_h, stride_ddr_s,
    stride_tb, stride_th, stride_tw,
    stride_nb, stride_nh, stride_tail, stride_head,
    block_split,
    G: tl.constexpr, G_PAD: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
    SINGLE: tl.constexpr, HEAD: tl.constexpr, PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Program (b, kh, split): online softmax of kh's G query heads over its share of list (b, kh)."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)
    n = tl.load(nblocks_ptr + b * stride_nb + kh * stride_nh)
    tail = tl.load(tail_ptr + b * stride_tail)
    skip = tl.load(head_ptr + b * stride_head) if HEAD else 0  # the first entry's tokens before the window
    start = split * block_split
    end = tl.minimum(start + block_split, n)

    rows_g = tl.arange(0, G_PAD)  # [G_PAD] query heads of kh (rows >= G are padding)
    cols = tl.arange(0, D)  # [D]
    heads = kh * G + rows_g
    q = (
        tl.load(
            q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + cols[None, :],
            mask=(rows_g < G)[:, None],
            other=0.0,
        )
        .to(k_hbm.dtype.element_ty)
        .to(DOT)
    )  # [G_PAD, D], rounded to the pools' dtype first

    r = tl.arange(0, CHUNK * BS)  # [TILE] key rows of a step: block r // BS, token r % BS
    r_blk = r // BS
    r_tok = r % BS
    table = tables_ptr + b.to(tl.int64) * stride_tb + kh.to(tl.int64) * stride_th
    head_hbm = kh.to(tl.int64) * stride_hbm_h
    head_ddr = kh.to(tl.int64) * stride_ddr_h
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    for i0 in range(start, end, CHUNK):
        j = i0 + r_blk  # [TILE] list entry of each row
        live = j < end
        loc = tl.load(table + j * stride_tw, mask=live, other=0)  # [TILE] int32
        in_hbm = loc >= 0
        slot = tl.where(in_hbm, loc, -loc - 1).to(tl.int64)
        offset = tl.where(in_hbm, head_hbm + slot * stride_hbm_s, head_ddr + slot * stride_ddr_s) + r_tok * D
        valid = live & ((j < n - 1) | (r_tok < tail))  # [TILE]: the last block has `tail` tokens
        if HEAD:
            valid = valid & ((j > 0) | (r_tok >= skip))
        tile = offset[:, None] + cols[None, :]  # [TILE, D]
        k = tl.load(tl.where(in_hbm, k_hbm, k_ddr)[:, None] + tile, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k.to(DOT)), input_precision=PRECISION) * qk_scale  # [G_PAD, TILE] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [G_PAD, TILE]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(tl.where(in_hbm, v_hbm, v_ddr)[:, None] + tile, mask=valid[:, None], other=0.0)
        pv = tl.dot(p.to(v.dtype).to(DOT), v.to(DOT), input_precision=PRECISION)  # [G_PAD, D]
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty list (nblocks == 0) gives zeros, not NaN
    o = acc / l_safe[:, None]
    keep = (rows_g < G)[:, None]
    row = b.to(tl.int64) * (G * tl.num_programs(1)) + heads  # [G_PAD] query head row of [B, H]
    if SINGLE:
        tl.store(out_ptr + row[:, None] * D + cols[None, :], o.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        nsplit = tl.num_programs(2)
        tl.store(part_o_ptr + (row[:, None] * nsplit + split) * D + cols[None, :], o, mask=keep)
        tl.store(part_lse_ptr + row * nsplit + split, m_i + tl.log2(l_safe), mask=rows_g < G)


def _merge_kernel(  # type: ignore[no-untyped-def]
    part_o_ptr, part_lse_ptr, nblocks_ptr, out_ptr,
    stride_nb, stride_nh, block_split, splits,
    SPLITS_PAD: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Program (b, h): out[b, h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over used splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(nblocks_ptr + b * stride_nb + (h // G) * stride_nh)
    s = tl.arange(0, SPLITS_PAD)
    used = s < tl.minimum(tl.cdiv(n, block_split), splits)  # splits past the list: not read
    row = b.to(tl.int64) * tl.num_programs(1) + h
    lse = tl.load(part_lse_ptr + row * splits + s, mask=used, other=float("-inf"))  # [SPLITS_PAD]
    top = tl.max(lse, 0)
    wgt = tl.where(used, tl.exp2(lse - top), 0.0)
    cols = tl.arange(0, D)
    o = tl.load(part_o_ptr + (row * splits + s[:, None]) * D + cols[None, :], mask=used[:, None], other=0.0)
    total = tl.sum(wgt, 0)
    merged = tl.sum(wgt[:, None] * o, 0) / tl.where(total > 0, total, 1.0)  # [D]
    tl.store(out_ptr + row * D + cols, merged.to(out_ptr.dtype.element_ty))
