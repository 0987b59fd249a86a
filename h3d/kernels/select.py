"""HBF's selection inside a captured decode step, as four Triton kernels (and their torch twins).

A decode step replayed as a CUDA graph (`h3d.engine.graphs`) selects, for each session under
`attention_entropy` and each sparse layer, the blocks each KV head reads. Written as torch ops
(`h3d.hbf.policy.select_static`, the twin) that is about forty small kernels per session and
layer, which the graph launches one after another: the launch of such a graph alone takes several
times the host time of one with these kernels (docs/BENCHMARKS.md, "GPU: h3d against transformers
on the H200", Decode). Here each is one launch per layer for every slot of the batch; a slot reads
its session's digests at its base row of the digest arena (`h3d.hbf.digests`), and a slot that
does not select (room 0: a session under `exact`, or padding) reads none and lists its whole table:

- `scores`, grid `(B, Hkv, cdiv(W, TILE))`: the digest bound of `TILE` blocks for one slot and KV
  head (each part's `hi . max(q, 0) + lo . min(q, 0)` for the head's `G` query heads, two `tl.dot`s
  with fp32 accumulation; the block's bound is the largest over heads and parts), then the
  selection's masks: past the session's blocks -inf, its first `take` prompt anchors +inf, sinks and
  the recent window -inf (they are listed anyway). Optionally the unmasked bounds too (the
  entropy's input).
- `top_room`, grid `(B, Hkv)`: each head's `room` best blocks (the room-th largest score found by
  bisection over its bits), faster than `torch.topk` and its sort at these sizes
  (docs/BENCHMARKS.md, "GPU: h3d against transformers on the H200", Decode: `top_room`).
- `lists`, grid `(B, Hkv)`: the head's list (sinks, its `room` best, the recent blocks, the partial
  block last), as block indices for the host (promotion) and as locations for the attention
  kernel, with its length; padding entries are 0 (the null slot).
- `fold`, grid `(B, Hkv)`: each slot's new key folded into its part's min and max
  (`DigestStore.fold`; a slot without a session folds into the arena's null extent).

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

TILE = 16  # blocks per `scores` program
# `scores`' way of reading a block's parts: False, one [TILE, D] load and two dots per part in
# turn; True, every part of the TILE blocks in one [TILE * P, D] load and two dots (a block's
# parts are consecutive rows of the arena), the largest bound per block taken after. Flat, 16
# blocks, 4 warps read the digests 2.4 x faster than the parts in turn, 64 blocks, 4 warps (the
# defaults before) on an H100: 131 against 315 µs a launch at 16 sessions of 32K, 249 against
# 617 at 32 (`python -m h3d.bench.scores`, docs/BENCHMARKS.md).
FLAT = True

# Bound by `_kernels()` at the first launch (the kernels below refer to `tl` as a global).
triton: Any = None
tl: Any = None


def available(device: torch.device) -> bool:
    """Whether the selection kernels run on `device` (else its caller runs the twin, `select_static`)."""
    return loader.runs_on(device)


# The arguments that follow a session's blocks, the anchors, the batch or the digest arena's
# rows (`h3d.kernels.loader`): not specialized on, so that a new length compiles nothing.
LOOSE = {
    "scores": ("dig_stride_h", "anchors_stride_b", "anchors_stride_h", "out_stride_b", "W", "A"),
    "top": ("m_stride_b", "m_stride_h", "out_stride_b", "out_stride_h", "W", "K"),
    "lists": (
        "top_stride_b",
        "top_stride_h",
        "table_stride_b",
        "heads_stride_b",
        "heads_stride_h",
        "nblocks_stride_b",
        "picked_stride_b",
        "picked_stride_h",
        "NW",
        "N_PICK",
        "K",
    ),
    "fold": ("dig_stride_h",),
}


@cache
def _kernels() -> SimpleNamespace:
    """Decorate the four selection kernels, once."""
    return loader.jit(globals(), LOOSE, scores=_scores_kernel, lists=_lists_kernel, top=_top_kernel, fold=_fold_kernel)


def scores(
    out: torch.Tensor,
    q: torch.Tensor,
    arena: torch.Tensor,
    parts: int,
    base: torch.Tensor,
    nb: torch.Tensor,
    parts_live: torch.Tensor,
    take: torch.Tensor,
    anchors: torch.Tensor,
    sinks: int,
    recent: int,
    raw: torch.Tensor | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    flat: bool | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Masked digest bounds of every slot of a batch into `out` [B, Hkv, W] fp32 (see the module
    docstring), one launch. q: [B, H, D]; arena: one layer of the digest arena [Hkv, rows, 2, D]
    (`DigestStore.arena`), `parts` rows per block; base, nb, parts_live, take: [B] int64 (each
    slot's first arena row, blocks, parts holding a key, anchors taken); anchors: [B, Hkv, A] int64.
    `raw` [B, Hkv, W] fp32, when given, receives the bounds before the masks (past nb: -inf). A
    part with no key yet (the partial block's last ones) bounds nothing (-inf), as its empty
    digest gives `block_scores`; a slot with no live part (parts_live 0: no selection) reads no
    digest and scores -inf. `shared` (src, parts) [B] int64: a slot's first `parts` parts lie at
    row src + p instead of base + p (a fork reading its parent's rows, `DigestStore.share`);
    None: none shared. `flat`, `tile` (a power of two, at least 16 / `parts` when flat),
    `num_warps`: how the kernel reads (`FLAT`, `TILE`; `python -m h3d.bench.scores` times them)."""
    k = _kernels()
    flat = FLAT if flat is None else flat
    tile = TILE if tile is None else tile
    launch = {} if num_warps is None else {"num_warps": num_warps}
    src, shared_parts = shared if shared is not None else (base, torch.zeros_like(base))
    b, hkv, w = out.shape
    d = arena.shape[-1]
    h = q.shape[1]
    g = h // hkv
    a = anchors.shape[2]
    k.scores[(b, hkv, triton.cdiv(w, tile))](
        q, arena, base, src, shared_parts, anchors, nb, parts_live, take, out, raw if raw is not None else out,
        q.stride(0), q.stride(1), arena.stride(0), arena.stride(1), anchors.stride(0), anchors.stride(1),
        out.stride(0), w, a,
        SINKS=sinks, RECENT=recent, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, P=parts, TILE=tile,
        A_PAD=max(16, triton.next_power_of_2(max(a, 1))), RAW=raw is not None,
        PRECISION="ieee" if arena.dtype == torch.float32 else "tf32",
        DOT=loader.dot_dtype(arena.dtype), FLAT=flat, P_PAD=triton.next_power_of_2(parts), **launch,
    )  # fmt: skip
    return out


def top_room(masked: torch.Tensor, room: torch.Tensor, k: int) -> torch.Tensor:
    """Each (slot, head) row's `room` best blocks of `masked` [B, Hkv, W] (room [B] int64; a slot
    whose room is 0 takes none), in ascending block order, in the first `room` entries of
    [B, Hkv, k] (the rest 0). One program per row finds the room-th largest score by bisection
    over its bits (32 counts), then writes the blocks above it and as many tied with it as fill
    the room (the lowest first). Against `torch.topk`: one launch instead of a select and a sort
    per row."""
    kern = _kernels()
    b, hkv, w = masked.shape
    out = torch.zeros((b, hkv, k), dtype=torch.int64, device=masked.device)
    kern.top[(b, hkv)](
        masked, room, out, masked.stride(0), masked.stride(1), out.stride(0), out.stride(1), w, k,
        W_PAD=triton.next_power_of_2(w), num_warps=8,
    )  # fmt: skip
    return out


def lists(
    top: torch.Tensor,
    table: torch.Tensor,
    nb: torch.Tensor,
    room: torch.Tensor,
    heads: torch.Tensor,
    nblocks: torch.Tensor,
    picked: torch.Tensor,
    sinks: int,
    recent: int,
) -> None:
    """Write the per-head lists of a batch of B: top [B, Hkv, k] (best first); table [B, W] int32
    locations; nb, room [B] int64 -> heads [B, Hkv, NW] int32 locations (0 past the list; NW >= W),
    nblocks [B, Hkv] int32, picked [B, Hkv, sinks + k + recent] int64 block indices. A slot that
    selects (room > 0) lists sinks, its best, the recent blocks; one that does not (room 0: a
    session under `exact`, or padding) lists its whole table."""
    k = _kernels()
    b, hkv, kk = top.shape
    width = heads.shape[2]
    n_pick = picked.shape[2]
    k.lists[(b, hkv)](
        top, table, nb, room, heads, nblocks, picked,
        top.stride(0), top.stride(1), table.stride(0), heads.stride(0), heads.stride(1), nblocks.stride(0),
        picked.stride(0), picked.stride(1), width, n_pick, kk, SINKS=sinks, RECENT=recent,
        E_PAD=triton.next_power_of_2(max(width, n_pick)),
    )  # fmt: skip


def fold(arena: torch.Tensor, rows: torch.Tensor, k: torch.Tensor) -> None:
    """Fold each slot's new key into its part's digest: arena [Hkv, rows, 2, D] (one layer of the
    digest arena); rows [B] int64 (each slot's part row: `DigestStore.fold`); k [B, Hkv, D]."""
    kern = _kernels()
    hkv, _, _, d = arena.shape
    b = k.shape[0]
    kern.fold[(b, hkv)](
        k, arena, rows, k.stride(0), k.stride(1), arena.stride(0), arena.stride(1),
        D=d, D_PAD=triton.next_power_of_2(d),
    )  # fmt: skip


# ---- the kernels (decorated at the first launch: h3d.kernels.loader.jit) ------------------------


def _scores_kernel(  # type: ignore[no-untyped-def]
    q, dig, base_ptr, src_ptr, shared_ptr, anchors, nb_ptr, parts_ptr, take_ptr, out, raw,
    q_stride_b, q_stride_h, dig_stride_h, dig_stride_part, anchors_stride_b, anchors_stride_h, out_stride_b, W, A,
    SINKS: tl.constexpr, RECENT: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    P: tl.constexpr, TILE: tl.constexpr, A_PAD: tl.constexpr, RAW: tl.constexpr,
    PRECISION: tl.constexpr, DOT: tl.constexpr, FLAT: tl.constexpr, P_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    j = tl.program_id(2).to(tl.int64) * TILE + tl.arange(0, TILE)  # [TILE] blocks
    inside = j < W
    nb = tl.load(nb_ptr + b)
    base = tl.load(base_ptr + b)
    src = tl.load(src_ptr + b)  # parts below `shared` are read from the source's rows
    shared = tl.load(shared_ptr + b)
    parts_live = tl.load(parts_ptr + b)  # parts past it hold their empty digests' sentinels (+-max): not loaded
    d = tl.arange(0, D)
    g = tl.arange(0, G_PAD)
    qg = tl.load(q + b * q_stride_b + (kh * G + g)[None, :] * q_stride_h + d[:, None], mask=(g < G)[None, :], other=0.0)
    qg = qg.to(tl.float32)  # [D, G_PAD]
    qpos = tl.maximum(qg, 0.0).to(DOT)
    qneg = tl.minimum(qg, 0.0).to(DOT)
    if FLAT:  # every part of the tile's blocks at once: row r is block r // P_PAD's part r % P_PAD
        rows = tl.arange(0, TILE * P_PAD)  # (not `r`: the anchors' block below names another shape so)
        p = rows % P_PAD
        part = (tl.program_id(2).to(tl.int64) * TILE + rows // P_PAD) * P + p
        live = (p < P) & (part < parts_live)
        drow = tl.where(part < shared, src, base) + part
        at = kh * dig_stride_h + drow * dig_stride_part  # [TILE * P_PAD]
        lo = tl.load(dig + at[:, None] + d[None, :], mask=live[:, None], other=0.0).to(DOT)
        hi = tl.load(dig + at[:, None] + D + d[None, :], mask=live[:, None], other=0.0).to(DOT)
        s = tl.dot(hi, qpos, input_precision=PRECISION) + tl.dot(lo, qneg, input_precision=PRECISION)
        s = tl.where((g < G)[None, :] & live[:, None], s, float("-inf"))  # [TILE * P_PAD, G_PAD]
        best = tl.max(tl.reshape(tl.max(s, axis=1), (TILE, P_PAD)), axis=1)
    else:
        best = tl.full([TILE], float("-inf"), tl.float32)
        for p in tl.static_range(P):
            part = j * P + p
            live = part < parts_live
            drow = tl.where(part < shared, src, base) + part
            at = kh * dig_stride_h + drow * dig_stride_part  # [TILE]: part p's (min, max) rows
            lo = tl.load(dig + at[:, None] + d[None, :], mask=live[:, None], other=0.0).to(DOT)
            hi = tl.load(dig + at[:, None] + D + d[None, :], mask=live[:, None], other=0.0).to(DOT)
            s = tl.dot(hi, qpos, input_precision=PRECISION) + tl.dot(lo, qneg, input_precision=PRECISION)
            s = tl.where((g < G)[None, :] & live[:, None], s, float("-inf"))  # [TILE, G_PAD]
            best = tl.maximum(best, tl.max(s, axis=1))
    best = tl.where(j < nb, best, float("-inf"))
    row = b * out_stride_b + kh * W + j
    if RAW:
        tl.store(raw + row, best, mask=inside)
    if A > 0:  # the first `take` anchors (clamped into the context, as `select` does) come first
        take = tl.load(take_ptr + b)
        r = tl.arange(0, A_PAD)
        a = tl.load(anchors + b * anchors_stride_b + kh * anchors_stride_h + r, mask=r < A, other=0)
        a = tl.minimum(a, nb - 1)
        hit = (a[None, :] == j[:, None]) & (r < take)[None, :]  # [TILE, A_PAD]
        best = tl.where(tl.max(hit.to(tl.int32), axis=1) > 0, float("inf"), best)
    best = tl.where((j < SINKS) | (j >= nb - RECENT), float("-inf"), best)  # listed anyway
    tl.store(out + row, best, mask=inside)


def _top_kernel(  # type: ignore[no-untyped-def]
    masked, room_ptr, out, m_stride_b, m_stride_h, out_stride_b, out_stride_h, W, K, W_PAD: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    r = tl.maximum(tl.load(room_ptr + s), 0).to(tl.int32)
    j = tl.arange(0, W_PAD)
    x = tl.load(masked + s * m_stride_b + kh * m_stride_h + j, mask=j < W, other=float("-inf"))
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
    take = (above | (tied & (tl.cumsum(tied.to(tl.int32), axis=0) <= need))) & (r > 0)
    at = tl.cumsum(take.to(tl.int32), axis=0) - 1
    tl.store(out + s * out_stride_b + kh * out_stride_h + at, j.to(tl.int64), mask=take & (at < K))


def _lists_kernel(  # type: ignore[no-untyped-def]
    top, table, nb_ptr, room_ptr, heads, nblocks, picked,
    top_stride_b, top_stride_h, table_stride_b, heads_stride_b, heads_stride_h, nblocks_stride_b,
    picked_stride_b, picked_stride_h, NW, N_PICK, K, SINKS: tl.constexpr, RECENT: tl.constexpr,
    E_PAD: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)  # the slot
    kh = tl.program_id(1).to(tl.int64)
    e = tl.arange(0, E_PAD)
    nb = tl.load(nb_ptr + i)
    room = tl.load(room_ptr + i)
    selects = room > 0
    n = tl.where(selects, SINKS + room + RECENT, nb)  # a slot that does not select reads every block
    from_top = (e >= SINKS) & (e < SINKS + room)
    t = tl.load(top + i * top_stride_b + kh * top_stride_h + (e - SINKS), mask=from_top & (e - SINKS < K), other=0)
    blk = tl.where(e < SINKS, e, tl.where(from_top, t, nb - RECENT + (e - SINKS - room)))
    blk = tl.where(selects, blk, e)
    valid = e < n
    blk = tl.where(valid, blk, 0)
    loc = tl.load(table + i * table_stride_b + blk, mask=valid, other=0)
    tl.store(heads + i * heads_stride_b + kh * heads_stride_h + e, tl.where(valid, loc, 0), mask=e < NW)
    tl.store(picked + i * picked_stride_b + kh * picked_stride_h + e, blk, mask=e < N_PICK)
    tl.store(nblocks + i * nblocks_stride_b + kh, n.to(tl.int32))


def _fold_kernel(  # type: ignore[no-untyped-def]
    k, dig, rows_ptr, k_stride_b, k_stride_h, dig_stride_h, dig_stride_part, D: tl.constexpr, D_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1).to(tl.int64)
    part = tl.load(rows_ptr + b)
    d = tl.arange(0, D_PAD)
    m = d < D
    x = tl.load(k + b * k_stride_b + kh * k_stride_h + d, mask=m).to(dig.dtype.element_ty).to(tl.float32)
    at = dig + kh * dig_stride_h + part * dig_stride_part
    lo = tl.load(at + d, mask=m).to(tl.float32)
    hi = tl.load(at + D + d, mask=m).to(tl.float32)
    tl.store(at + d, tl.minimum(lo, x).to(dig.dtype.element_ty), mask=m)
    tl.store(at + D + d, tl.maximum(hi, x).to(dig.dtype.element_ty), mask=m)
