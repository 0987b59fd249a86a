"""HBF's selection inside a captured decode step, as three Triton kernels (and their torch twins).

A decode step replayed as a CUDA graph (`h3d.engine.graphs`) selects, for each session under
`attention_entropy` and each sparse layer, the blocks each KV head reads. Written as torch ops
(`h3d.hbf.policy.select_static`, the twin) that is about forty small kernels per session and
layer, which the graph launches one after another: the launch of such a graph alone takes several
times the host time of one with these kernels (docs/BENCHMARKS.md, "GPU: h3d against transformers
on the H200", Decode). Here it is a kernel per session and layer, and two kernels per layer for
the whole batch:

- `scores`, grid `(Hkv, cdiv(W, TILE))`: the digest bound of `TILE` blocks for one KV head (each
  part's `hi . max(q, 0) + lo . min(q, 0)` for the head's `G` query heads, two `tl.dot`s with fp32
  accumulation; the block's bound is the largest over heads and parts), then the selection's
  masks: past the session's blocks -inf, its first `take` prompt anchors +inf, sinks and the recent
  window -inf (they are listed anyway). Optionally the unmasked bounds too (the entropy's input).
- `top_room`, grid `(E, Hkv)`, every session of the batch in one launch: each head's `room`
  best blocks (the room-th largest score found by bisection over its bits), faster than
  `torch.topk` and its sort at these sizes (docs/BENCHMARKS.md, "GPU: h3d against transformers on
  the H200", Decode: `top_room`).
- `lists`, grid `(E, Hkv)`, every session of the batch in one launch: the head's list (sinks,
  its `room` best, the recent blocks, the partial block last), as block indices for the host
  (promotion) and as locations for the attention kernel, with its length; padding entries are 0
  (the null slot).
- `fold`, grid `(Hkv,)`: the new key folded into its part's min and max (`DigestStore.fold`).

Every input that changes between steps (block count, room, anchors taken, the token's position)
is read from a device tensor, so the kernels replay as they were captured. Under
`TRITON_INTERPRET=1` the kernels run on the CPU (the tests compare them with the twins); without
Triton, or on a CPU without the interpreter, the twins run.
"""

from __future__ import annotations

from functools import cache
from types import SimpleNamespace
from typing import Any

import torch

from h3d.kernels import loader

TILE = 64  # blocks per `scores` program

# Bound by `_kernels()` at the first launch (the kernels below refer to `tl` as a global).
triton: Any = None
tl: Any = None


def available(device: torch.device) -> bool:
    """Whether the selection kernels run on `device` (else its caller runs the twin, `select_static`)."""
    return loader.runs_on(device)


@cache
def _kernels() -> SimpleNamespace:
    """Decorate the four selection kernels, once."""
    return loader.jit(globals(), scores=_scores_kernel, lists=_lists_kernel, top=_top_kernel, fold=_fold_kernel)


def scores(
    out: torch.Tensor,
    q: torch.Tensor,
    digests: torch.Tensor,
    nb: torch.Tensor,
    parts_live: torch.Tensor,
    take: torch.Tensor,
    anchors: torch.Tensor,
    sinks: int,
    recent: int,
    raw: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked digest bounds into `out` [Hkv, W] fp32 (see the module docstring). q: [H, D]; digests:
    [Hkv, W, parts, 2, D] (parts contiguous); nb, parts_live, take: 0-dim int64 (blocks, parts
    holding a key, anchors taken); anchors: [Hkv, A] int64. `raw` [Hkv, W] fp32, when given,
    receives the bounds before the masks (past nb: -inf). A part with no key yet (the partial
    block's last ones) bounds nothing (-inf), as its empty digest gives `block_scores`."""
    k = _kernels()
    hkv, w, parts, _, d = digests.shape
    h = q.shape[0]
    g = h // hkv
    a = anchors.shape[1]
    k.scores[(hkv, triton.cdiv(w, TILE))](
        q, digests, anchors, nb, parts_live, take, out, raw if raw is not None else out,
        q.stride(0), digests.stride(0), digests.stride(2), anchors.stride(0), w, a,
        SINKS=sinks, RECENT=recent, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, P=parts, TILE=TILE,
        A_PAD=max(16, triton.next_power_of_2(max(a, 1))), RAW=raw is not None,
        PRECISION="ieee" if digests.dtype == torch.float32 else "tf32",
        DOT=loader.dot_dtype(digests.dtype),
    )  # fmt: skip
    return out


def top_room(masked: torch.Tensor, entries: torch.Tensor, room: torch.Tensor, k: int) -> torch.Tensor:
    """Each (session, head) row's `room` best blocks of `masked` [E, Hkv, W] (room [B] int64, read
    at `entries` [E]), in ascending block order, in the first `room` entries of [E, Hkv, k] (the
    rest 0). One program per row finds the room-th largest score by bisection over its bits
    (32 counts), then writes the blocks above it and as many tied with it as fill the room (the
    lowest first). Against `torch.topk`: one launch instead of a select and a sort per row."""
    kern = _kernels()
    e, hkv, w = masked.shape
    out = torch.zeros((e, hkv, k), dtype=torch.int64, device=masked.device)
    kern.top[(e, hkv)](
        masked, entries, room, out, masked.stride(0), masked.stride(1), out.stride(0), out.stride(1), w, k,
        W_PAD=triton.next_power_of_2(w), num_warps=8,
    )  # fmt: skip
    return out


def lists(
    top: torch.Tensor,
    table: torch.Tensor,
    entries: torch.Tensor,
    nb: torch.Tensor,
    room: torch.Tensor,
    heads: torch.Tensor,
    nblocks: torch.Tensor,
    picked: torch.Tensor,
    sinks: int,
    recent: int,
) -> None:
    """Write the per-head lists of E sessions of a batch of B: top [E, Hkv, k] (best first);
    table [B, W] int32 locations; entries [E] int64 (each session's batch index); nb, room [B]
    int64 -> heads [B, Hkv, NW] int32 locations (0 past the list), nblocks [B, Hkv] int32 (the
    entries' rows), picked [E, Hkv, sinks + k + recent] int64 block indices."""
    k = _kernels()
    e, hkv, kk = top.shape
    width = heads.shape[2]
    n_pick = picked.shape[2]
    k.lists[(e, hkv)](
        top, table, entries, nb, room, heads, nblocks, picked,
        top.stride(0), top.stride(1), table.stride(0), heads.stride(0), heads.stride(1), nblocks.stride(0),
        picked.stride(0), picked.stride(1), width, n_pick, kk, SINKS=sinks, RECENT=recent,
        E_PAD=triton.next_power_of_2(max(width, n_pick)),
    )  # fmt: skip


def fold(digests: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, part_tokens: int) -> None:
    """Fold one key into its part's digest: digests [Hkv, cap, 2, D] (one layer of a session's
    store); pos [1] int64; k [1, Hkv, D]."""
    kern = _kernels()
    hkv, _, _, d = digests.shape
    kern.fold[(hkv,)](
        k, digests, pos, k.stride(1), digests.stride(0), digests.stride(1),
        PT=part_tokens, D=d, D_PAD=triton.next_power_of_2(d),
    )  # fmt: skip


# ---- the kernels (decorated at the first launch: h3d.kernels.loader.jit) ------------------------


def _scores_kernel(  # type: ignore[no-untyped-def]
    q, dig, anchors, nb_ptr, parts_ptr, take_ptr, out, raw,
    q_stride_h, dig_stride_h, dig_stride_part, anchors_stride_h, W, A,
    SINKS: tl.constexpr, RECENT: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    P: tl.constexpr, TILE: tl.constexpr, A_PAD: tl.constexpr, RAW: tl.constexpr,
    PRECISION: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    kh = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)  # [TILE] blocks
    inside = j < W
    nb = tl.load(nb_ptr)
    parts_live = tl.load(parts_ptr)  # parts past it hold their empty digests' sentinels (+-max): not loaded
    d = tl.arange(0, D)
    g = tl.arange(0, G_PAD)
    qg = tl.load(q + (kh * G + g)[None, :] * q_stride_h + d[:, None], mask=(g < G)[None, :], other=0.0)
    qg = qg.to(tl.float32)  # [D, G_PAD]
    qpos = tl.maximum(qg, 0.0).to(DOT)
    qneg = tl.minimum(qg, 0.0).to(DOT)
    best = tl.full([TILE], float("-inf"), tl.float32)
    for p in tl.static_range(P):
        part = j * P + p
        live = part < parts_live
        at = kh * dig_stride_h + part * dig_stride_part  # [TILE]: part p's (min, max) rows
        lo = tl.load(dig + at[:, None] + d[None, :], mask=live[:, None], other=0.0).to(DOT)
        hi = tl.load(dig + at[:, None] + D + d[None, :], mask=live[:, None], other=0.0).to(DOT)
        s = tl.dot(hi, qpos, input_precision=PRECISION) + tl.dot(lo, qneg, input_precision=PRECISION)
        s = tl.where((g < G)[None, :] & live[:, None], s, float("-inf"))  # [TILE, G_PAD]
        best = tl.maximum(best, tl.max(s, axis=1))
    best = tl.where(j < nb, best, float("-inf"))
    if RAW:
        tl.store(raw + kh * W + j, best, mask=inside)
    if A > 0:  # the first `take` anchors (clamped into the context, as `select` does) come first
        take = tl.load(take_ptr)
        r = tl.arange(0, A_PAD)
        a = tl.load(anchors + kh * anchors_stride_h + r, mask=r < A, other=0)
        a = tl.minimum(a, nb - 1)
        hit = (a[None, :] == j[:, None]) & (r < take)[None, :]  # [TILE, A_PAD]
        best = tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, float("inf"), best)
    best = tl.where((j < SINKS) | (j >= nb - RECENT), float("-inf"), best)  # listed anyway
    tl.store(out + kh * W + j, best, mask=inside)


def _top_kernel(  # type: ignore[no-untyped-def]
    masked, entries, room_ptr, out, m_stride_e, m_stride_h, out_stride_e, out_stride_h, W, K, W_PAD: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    r = tl.load(room_ptr + tl.load(entries + s)).to(tl.int32)
    j = tl.arange(0, W_PAD)
    x = tl.load(masked + s * m_stride_e + kh * m_stride_h + j, mask=j < W, other=float("-inf"))
    # Float -> int32 keys in the same order (negative floats' bits flipped), so bisection over
    # int32 finds the room-th largest score exactly.
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    lo = tl.min(key, axis=0)  # count(key >= lo) = W_PAD >= r
    hi = tl.max(key, axis=0)
    for _ in range(33):  # invariant: count(key >= lo) >= r; the answer lies in [lo, hi]
        mid = lo + ((hi - lo + 1) >> 1)  # upper middle (int64: hi - lo may pass 2**31)
        ok = tl.sum((key >= mid).to(tl.int32), axis=0) >= r
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    above = key > lo
    tied = key == lo
    need = r - tl.sum(above.to(tl.int32), axis=0)  # ties to take, the lowest blocks first
    take = above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))
    at = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out + s * out_stride_e + kh * out_stride_h + at, j.to(tl.int64), mask=take & (at < K))


def _lists_kernel(  # type: ignore[no-untyped-def]
    top, table, entries, nb_ptr, room_ptr, heads, nblocks, picked,
    top_stride_e, top_stride_h, table_stride_b, heads_stride_b, heads_stride_h, nblocks_stride_b,
    picked_stride_e, picked_stride_h, NW, N_PICK, K, SINKS: tl.constexpr, RECENT: tl.constexpr,
    E_PAD: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    i = tl.load(entries + s)  # the session's batch index
    e = tl.arange(0, E_PAD)
    nb = tl.load(nb_ptr + i)
    room = tl.load(room_ptr + i)
    n = SINKS + room + RECENT
    from_top = (e >= SINKS) & (e < SINKS + room)
    t = tl.load(top + s * top_stride_e + kh * top_stride_h + (e - SINKS), mask=from_top & (e - SINKS < K), other=0)
    blk = tl.where(e < SINKS, e, tl.where(from_top, t, nb - RECENT + (e - SINKS - room)))
    valid = e < n
    blk = tl.where(valid, blk, 0)
    loc = tl.load(table + i * table_stride_b + blk, mask=valid, other=0)
    tl.store(heads + i * heads_stride_b + kh * heads_stride_h + e, tl.where(valid, loc, 0), mask=e < NW)
    tl.store(picked + s * picked_stride_e + kh * picked_stride_h + e, blk, mask=e < N_PICK)
    tl.store(nblocks + i * nblocks_stride_b + kh, n.to(tl.int32))


def _fold_kernel(  # type: ignore[no-untyped-def]
    k, dig, pos_ptr, k_stride_h, dig_stride_h, dig_stride_part, PT: tl.constexpr, D: tl.constexpr,
    D_PAD: tl.constexpr,
):  # fmt: skip
    kh = tl.program_id(0).to(tl.int64)
    part = tl.load(pos_ptr) // PT
    d = tl.arange(0, D_PAD)
    m = d < D
    x = tl.load(k + kh * k_stride_h + d, mask=m).to(dig.dtype.element_ty).to(tl.float32)
    at = dig + kh * dig_stride_h + part * dig_stride_part
    lo = tl.load(at + d, mask=m).to(tl.float32)
    hi = tl.load(at + D + d, mask=m).to(tl.float32)
    tl.store(at + d, tl.minimum(lo, x).to(dig.dtype.element_ty), mask=m)
    tl.store(at + D + d, tl.maximum(hi, x).to(dig.dtype.element_ty), mask=m)
