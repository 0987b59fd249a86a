"""Attention over the paged KV cache, reading every block where it is (HBM or DDR pool).

Two implementations with one signature (`AttentionFn`):

- `reference_attention`: gather every block named in the layer's location table, softmax in fp32.
  The oracle that every faster path is compared with (padding reads the zero null slot, masked).
- `paged_attention`: the CPU fast path. A sequence's blocks of one layer mostly sit in consecutive
  slots (see `h3d.kv.blocks`), so a decode step reads each run of consecutive slots in place as a
  strided view of its pool (no gather copy), concatenates the runs' scores, and sums the runs'
  probability-weighted values; a prefill chunk goes through torch SDPA over the same views.
  Sequences whose blocks are scattered into more than `MAX_RUNS` runs are gathered first.
  A short sequence's decode attention is a dozen tiny ops; those run on one thread
  (`SERIAL_ELEMENTS`, `one_thread`), because each of them would otherwise open an OpenMP parallel
  region, and with the daemon's passive wait policy (`h3d.engine.threads`) waking a sleeping
  partner thread costs ten times the op itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from h3d.kernels.copies import to_device
from h3d.kv.blocks import Runs

MAX_RUNS = 8
# A decode sequence whose keys hold at most this many elements (KV heads x tokens x head dim) is
# attended on one thread: below it a parallel region costs more than it saves (about 50 us to wake
# a passive OpenMP thread, against 5 us per op; docs/BENCHMARKS.md, "Small ops on one thread").
SERIAL_ELEMENTS = 1 << 16


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch's intra-op thread count set to 1 for the block (ops run inline, no parallel region),
    restored after. Cheap (a fraction of a microsecond each way). The count is the calling thread's
    (OpenMP's nthreads ICV): threads that already ran torch ops keep theirs; one whose first op
    falls inside the block takes 1 (ATen's global default)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@dataclass(frozen=True, slots=True)
class Pools:
    """The K and V slabs of every tier attention can read, indexed by `Tier` (HBM, DDR).

    Each slab is [Hkv, slots, block_size, D]: for each KV head a run of slots is one matrix.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    def heads(self, first: int, end: int) -> Pools:
        """The slabs of KV heads first..end-1 only (views)."""
        return Pools(k=tuple(p[first:end] for p in self.k), v=tuple(p[first:end] for p in self.v))


@dataclass(frozen=True, slots=True)
class LayerKV:
    """What one layer's attention needs for the packed sequences of a forward pass.

    Sequence i owns `query_lens[i]` consecutive rows of q; its keys are the first `kv_lens[i]`
    tokens of its blocks (the new tokens included). `runs[i]` lists its blocks as runs of slots;
    `tables()` builds the padded location table [B, W] (HBM slot, or -(DDR slot + 1)) for gathers.
    A decode step whose selection differs per KV head has `head_locs[i]`, [Hkv, n] locations (each
    row that head's blocks, ascending): its `runs[i]` and `tables()` row then list the union, and
    `head_tables()` gives every sequence's per-head lists, [B, Hkv, W] (shared lists repeated).

    `fresh`, when set, holds the forward's new K and V ([N, Hkv, D] each, packed like q): a
    prefill chunk (more than one query) then attends to its own tokens from there, and its
    `runs[i]` list only the blocks before the chunk (their first kv_len - n tokens are read), so
    that a chunk never reads back what it has just written (over PCIe, for blocks placed in DDR).
    `window`, when set, limits every query to its last `window` positions (sliding-window layers).
    """

    query_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    runs: tuple[Runs, ...]
    tables: Callable[[], torch.Tensor]
    head_locs: tuple[np.ndarray | None, ...] = ()
    head_tables: Callable[[], torch.Tensor] | None = None
    # A decode step planned on the device: the kernel's (tables [B, Hkv, W], nblocks [B, Hkv],
    # tails [B]) already there (`h3d.engine.stepkv.DeviceStepKV`); `runs` are then empty.
    lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # With `lists` of a sliding-window layer (`window_lists`): [B] tokens of each first listed
    # block before the window (the kernel's `head`).
    head: torch.Tensor | None = None
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None
    # A sliding-window layer's window: a query at position p reads keys p - window < j <= p only
    # (positions within what `runs` list: a decode step may list only the window's blocks).
    window: int | None = None

    def heads(self, first: int, end: int) -> LayerKV:
        """What attention over KV heads first..end-1 only reads (with `Pools.heads` and those
        heads' queries): a long chunk's attention in pieces (`DecoderLayer.stages`)."""
        assert self.lists is None, "a decode step planned on the device is never split"
        whole = self.head_tables
        return replace(
            self,
            head_locs=tuple(None if h is None else h[first:end] for h in self.head_locs),
            head_tables=None if whole is None else (lambda: whole()[:, first:end]),
            fresh=None if self.fresh is None else (self.fresh[0][:, first:end], self.fresh[1][:, first:end]),
        )


def gather_blocks(pools: tuple[torch.Tensor, ...], loc: torch.Tensor) -> torch.Tensor:
    """pools: (HBM, DDR) [Hkv, S, bs, D]; loc: [..., W] -> [..., W*bs, Hkv, D] (fp32).

    Only the blocks that DDR holds are read from it (on a GPU a read of the pinned pool at every
    location, widened to fp32 on the host, took seconds for a 128K-token prompt's probe)."""
    hbm, ddr = pools
    g = hbm[:, loc.clamp(min=0)]  # [Hkv, ..., W, bs, D]
    below = loc < 0
    if bool(below.any()):
        g[:, below] = ddr[:, (-loc[below] - 1).to(ddr.device)].to(hbm.device)
    return g.float().reshape(hbm.shape[0], *loc.shape[:-1], -1, hbm.shape[-1]).movedim(0, -2)


def head_major(pools: tuple[torch.Tensor, ...], loc: np.ndarray, tokens: int) -> torch.Tensor:
    """The first `tokens` rows of the blocks at `loc` (HBM slots >= 0, DDR ones < 0, in order),
    per KV head: [Hkv, tokens, D] in the pools' dtype. A view of the HBM pool where the blocks are
    one run of its slots (a session's blocks mostly are), else gathered (DDR's read on the host);
    no host sync either way."""
    hbm, ddr = pools
    hkv, _, bs, d = hbm.shape
    n = len(loc)
    if n and loc[0] >= 0 and int(loc[-1]) - int(loc[0]) == n - 1 and (np.diff(loc) == 1).all():
        return hbm[:, int(loc[0]) : int(loc[0]) + n].reshape(hkv, n * bs, d)[:, :tokens]
    g = hbm[:, to_device(np.maximum(loc, 0), hbm.device)]  # [Hkv, n, bs, D]
    below = np.flatnonzero(loc < 0)
    if len(below):
        rows = to_device(-loc[below] - 1, ddr.device)
        g[:, to_device(below, hbm.device)] = ddr[:, rows].to(hbm.device)
    return g.reshape(hkv, n * bs, d)[:, :tokens]


def decode_attention(
    q: torch.Tensor, pools: Pools, tables: torch.Tensor, kv_lens: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """One query token per sequence. q: [B, H, D]; tables: [B, W]; kv_lens: [B] -> [B, H, D];
    `window`: only the last `window` keys of each sequence."""
    b, h, d = q.shape
    k = gather_blocks(pools.k, tables)  # [B, T, Hkv, D]
    v = gather_blocks(pools.v, tables)  # [B, T, Hkv, D]
    hkv = k.shape[2]
    qg = q.float().view(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    t = torch.arange(k.shape[1], device=q.device)
    past = t[None, :] >= kv_lens[:, None]  # [B, T]: padding and unwritten rows
    if window is not None:
        past |= t[None, :] < kv_lens[:, None] - window  # before the window
    k = k.masked_fill(past[..., None, None], 0.0)
    v = v.masked_fill(past[..., None, None], 0.0)
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale  # [B, Hkv, G, T]
    scores.masked_fill_(past[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def prefill_attention(
    q: torch.Tensor, pools: Pools, table: torch.Tensor, kv_len: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """A chunk of one sequence's queries, causal. q: [n, H, D]; table: [W] -> [n, H, D].

    The n queries are the sequence's last n tokens: query j sits at position kv_len - n + j and
    sees keys 0..that position (the last `window` of them only, with a window).
    """
    n, h, d = q.shape
    k = gather_blocks(pools.k, table)[:kv_len]  # [T, Hkv, D]
    v = gather_blocks(pools.v, table)[:kv_len]  # [T, Hkv, D]
    hkv = k.shape[1]
    qg = q.float().view(n, hkv, h // hkv, d)  # [n, Hkv, G, D]
    scores = torch.einsum("nkgd,tkd->kgnt", qg, k) * scale  # [Hkv, G, n, T]
    qpos = torch.arange(kv_len - n, kv_len, device=q.device)
    kpos = torch.arange(kv_len, device=q.device)
    hidden = kpos[None, :] > qpos[:, None]
    if window is not None:
        hidden |= kpos[None, :] <= qpos[:, None] - window
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgnt,tkd->nkgd", probs, v)  # [n, Hkv, G, D]
    return out.reshape(n, h, d).to(q.dtype)


def _head_lists(q: torch.Tensor, pools: Pools, layer: LayerKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step's lists for the paged kernel: tables [B, Hkv, W], nblocks [B, Hkv] and tails
    [B] (int32, on q's device). Every listed block is full but the sequence's last, partial one."""
    bs, hkv = pools.k[0].shape[2], pools.k[0].shape[0]
    kv_lens = torch.tensor(layer.kv_lens, dtype=torch.int32)
    nblocks = (kv_lens + bs - 1) // bs
    tail = kv_lens - (nblocks - 1) * bs
    if layer.head_tables is not None:
        tables = layer.head_tables().to(torch.int32)
    else:
        shared = layer.tables().to(torch.int32)  # [B, W]: every KV head reads the same blocks
        tables = shared[:, None, :].expand(shared.shape[0], hkv, shared.shape[1])
    b = tables.shape[0]
    return tables, nblocks[:, None].expand(b, hkv).to(q.device), tail.to(q.device)


def window_lists(
    table: torch.Tensor, nblocks: torch.Tensor, tail: torch.Tensor, window: int, block_size: int, hkv: int
) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """A sliding-window layer's decode lists from whole tables, on the device (no host value read:
    a captured step's): table [B, W] locations, nblocks [B] (the new token's block included), tail
    [B] -> ((tables [B, Hkv, W] int32, nblocks [B, Hkv] int32, tail), head [B] int32): each
    sequence's blocks from the one its window starts in, and the tokens of that block before it."""
    kv_len = (nblocks.to(torch.int64) - 1) * block_size + tail.to(torch.int64)
    start = (kv_len - window).clamp(min=0)
    first = start // block_size
    w = table.shape[1]
    shifted = table.gather(1, (first[:, None] + torch.arange(w, device=table.device)).clamp(max=w - 1))
    count = (nblocks.to(torch.int64) - first).to(torch.int32)
    lists = (shifted.to(torch.int32)[:, None, :].expand(-1, hkv, -1), count[:, None].expand(-1, hkv), tail)
    return lists, (start - first * block_size).to(torch.int32)


def reference_attention(
    q: torch.Tensor, pools: Pools, layer: LayerKV, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention for every packed sequence, by gathering every block it reads from the pools (the
    new tokens' too: `fresh` and `out` are not used). q: [N, H, D] -> [N, H, D]."""
    if layer.head_tables is not None or layer.lists is not None:  # per-KV-head lists
        from h3d.kernels.decode import torch_paged_decode

        assert layer.window is None, "a sliding-window layer never selects per KV head"

        lists = layer.lists if layer.lists is not None else _head_lists(q, pools, layer)
        return torch_paged_decode(q, (pools.k[0], pools.k[1]), (pools.v[0], pools.v[1]), *lists, scale, layer.head)
    tables = layer.tables()  # [B, W]
    if all(n == 1 for n in layer.query_lens):
        kv_lens = to_device(np.asarray(layer.kv_lens, dtype=np.int64), q.device)
        return decode_attention(q, pools, tables, kv_lens, scale, layer.window)
    outs = []
    start = 0
    for i, (n, kv_len) in enumerate(zip(layer.query_lens, layer.kv_lens, strict=True)):
        outs.append(prefill_attention(q[start : start + n], pools, tables[i], kv_len, scale, layer.window))
        start += n
    return torch.cat(outs, dim=0)


def _segments(pools: tuple[torch.Tensor, ...], runs: Runs) -> list[torch.Tensor]:
    """Views of the pools for each run, [Hkv, t, D] each: every head's keys of a run are one
    contiguous matrix. One gathered tensor instead if the runs are many (`head_major`: in the
    pools' dtype, no host sync)."""
    hkv, _, bs, d = pools[0].shape
    device = pools[0].device
    if len(runs) > MAX_RUNS:
        loc = np.concatenate([np.arange(s, s + c) if t == 0 else -np.arange(s, s + c) - 1 for t, s, c in runs])
        return [head_major(pools, loc, len(loc) * bs)]
    return [pools[t][:, s : s + c].view(hkv, c * bs, d).to(device, non_blocking=True) for t, s, c in runs]


def run_attention(
    q: torch.Tensor,
    pools: Pools,
    runs: Runs,
    kv_len: int,
    scale: float,
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence's last n queries over its blocks read in place. q: [n, H, D] -> [n, H, D].
    A chunk (n > 1) with `fresh` (its own K/V, [n, Hkv, D] each) reads only its first kv_len - n
    keys from `runs`; `out` may receive the result (see `causal_attention`); `window`: each query
    reads its last `window` positions only."""
    n, h, d = q.shape
    if n > 1:
        return _chunk_attention(q, pools, runs, kv_len, scale, fresh, out, window)
    # One query: every KV head's group of queries in one bmm per run, keys read in place.
    hkv = pools.k[0].shape[0]
    qh = q.float().view(hkv, h // hkv, d) * scale  # [Hkv, G, D]
    keys = _segments(pools.k, runs)
    scores = torch.cat([torch.bmm(qh, k.transpose(1, 2).float()) for k in keys], dim=-1)  # [Hkv, G, T]
    # The tail of the last block past kv_len is unwritten: dropped, not masked.
    if window is not None and kv_len > window:
        scores[..., : kv_len - window] = float("-inf")  # before the window (a fresh tensor: cat's)
    probs = torch.softmax(scores[..., :kv_len], dim=-1)
    acc: torch.Tensor | None = None
    offset = 0
    for v in _segments(pools.v, runs):
        t = min(v.shape[1], kv_len - offset)
        part = torch.bmm(probs[..., offset : offset + t], v[:, :t].float())  # [Hkv, G, D]
        acc = part if acc is None else acc + part
        offset += t
    assert acc is not None
    return acc.reshape(1, h, d).to(q.dtype)


def _gather_heads(pools: tuple[torch.Tensor, ...], loc: torch.Tensor) -> torch.Tensor:
    """pools: (HBM, DDR) [Hkv, S, bs, D]; loc: [Hkv, n], one list per KV head -> [Hkv, n*bs, D]
    (fp32): each head's own blocks only (`gather_blocks` would read every head of each block)."""
    hbm, ddr = pools
    heads = torch.arange(loc.shape[0], device=loc.device)[:, None]
    from_hbm = hbm[heads, loc.clamp(min=0)].float()  # [Hkv, n, bs, D]
    from_ddr = ddr[heads.to(ddr.device), (-loc - 1).clamp(min=0).to(ddr.device)].float().to(hbm.device)
    g = torch.where((loc >= 0)[..., None, None], from_hbm, from_ddr)
    return g.reshape(loc.shape[0], -1, hbm.shape[-1])


def head_attention(q: torch.Tensor, pools: Pools, locs: np.ndarray, kv_len: int, scale: float) -> torch.Tensor:
    """One query over a different block list for each KV head (gathered: a selection is small).
    q: [1, H, D]; locs: [Hkv, n] locations, ascending, the last the partial block -> [1, H, D]."""
    _, h, d = q.shape
    hkv = locs.shape[0]
    loc = to_device(np.ascontiguousarray(locs), pools.k[0].device)
    k = _gather_heads(pools.k, loc)[:, :kv_len]  # [Hkv, T, D]
    v = _gather_heads(pools.v, loc)[:, :kv_len]
    qh = q.float().view(hkv, h // hkv, d) * scale  # [Hkv, G, D]
    probs = torch.softmax(torch.bmm(qh, k.transpose(1, 2)), dim=-1)  # [Hkv, G, T]
    return torch.bmm(probs, v).reshape(1, h, d).to(q.dtype)


def _chunk_attention(
    q: torch.Tensor,
    pools: Pools,
    runs: Runs,
    kv_len: int,
    scale: float,
    fresh: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """A prefill chunk (n > 1 queries): torch SDPA over the runs (views, or one copy if several),
    and over the chunk's own K/V where `fresh` holds them; with a `window`, over each tile of
    queries' band of keys (`window_attention`).

    A chunk that starts its sequence with its K/V at hand needs no mask at all (`causal_attention`).
    Otherwise SDPA's CPU kernel accumulates in fp32 and reads the keys once per query tile, faster
    than materializing the [n, T] scores here (docs/BENCHMARKS.md, "CPU: h3d against transformers
    on the embedded model", layout choices); the unwritten tail of the last block is sliced off and
    the mask is causal, aligned to the lower right (`causal_lower_right_attention`).
    """
    n = q.shape[0]
    prior = kv_len - n if fresh is not None else kv_len  # keys read from the pools
    if fresh is not None and prior == 0:
        if window is not None and n > window:
            return window_attention(q, fresh[0].transpose(0, 1), fresh[1].transpose(0, 1), scale, window)
        return causal_attention(q, fresh[0], fresh[1], scale, out)
    keys, values = _segments(pools.k, runs), _segments(pools.v, runs)
    if fresh is not None and window is None and _segmented(q, keys):
        return segmented_attention(q, keys, values, prior, fresh, scale)
    k = (keys[0] if len(keys) == 1 else torch.cat(keys, dim=1))[:, :prior]  # [Hkv, T, D]
    v = (values[0] if len(values) == 1 else torch.cat(values, dim=1))[:, :prior]  # [Hkv, T, D]
    if fresh is not None:
        k = torch.cat([k.to(fresh[0].dtype), fresh[0].transpose(0, 1)], dim=1)
        v = torch.cat([v.to(fresh[1].dtype), fresh[1].transpose(0, 1)], dim=1)
    if window is not None:
        return window_attention(q, k, v, scale, window)
    return causal_lower_right_attention(q, k, v, scale)


# Whether a chunk over cached keys is attended segment by segment (`segmented_attention`) where
# flash attention runs; the warm-up turns it off if the device disagrees with the copying path
# (`segments_agree`).
chunk_segments = True


def _segmented(q: torch.Tensor, keys: list[torch.Tensor]) -> bool:
    return chunk_segments and _flash_lower_right(q) and all(k.dtype == q.dtype for k in keys)


def segmented_attention(
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    prior: int,
    fresh: tuple[torch.Tensor, torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """A chunk's attention over its cached keys and its own, with nothing copied: q [n, H, D] (the
    sequence's last n tokens); keys, values: the cached segments [Hkv, t, D] (views of the pool, or
    one gathered tensor), of which the first `prior` rows count; fresh: the chunk's K/V [n, Hkv, D]
    -> [n, H, D]. Every query sees every cached key, so each segment is one attention without a
    mask, and the chunk's own keys one with the causal mask; the parts are merged by their
    log-sum-exps. The copying path concatenates the cached keys and the chunk's (a copy of the
    whole context a layer) and repeats K/V over the query heads (four more for a GQA of 4): on an
    H100, 30 of the 64 ms of the device a chat's second turn over 32K of history took
    (docs/BENCHMARKS.md). Flash attention reads grouped K/V as they are."""
    parts = []
    left = prior
    for k, v in zip(keys, values, strict=True):
        t = min(k.shape[1], left)
        if t > 0:
            parts.append(attend_lse(q, k[:, :t], v[:, :t], scale, causal=False))
        left -= t
    parts.append(attend_lse(q, fresh[0].transpose(0, 1), fresh[1].transpose(0, 1), scale, causal=True))
    return merge_parts(parts).to(q.dtype)


def attend_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [n, H, D] over k, v [Hkv, t, D] (query head j reads KV head j // (H / Hkv)) -> (out
    [n, H, D], log-sum-exp of each row's scaled scores [H, n], fp32). `causal`: the queries are
    the keys' last n (lower right). Flash attention where it runs (`_flash_lower_right`, K/V of
    q's dtype); its twin, the scores written out in fp32, elsewhere (the tests' CPU)."""
    n, h, d = q.shape
    hkv, t, _ = k.shape
    if _flash_lower_right(q) and k.dtype == q.dtype and v.dtype == q.dtype:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.transpose(0, 1)[None], k[None], v[None], 0.0, is_causal=causal, return_debug_mask=False, scale=scale
        )[:2]
        return out[0].transpose(0, 1), lse[0]
    g = h // hkv
    qh = q.float().transpose(0, 1).reshape(hkv, g * n, d)  # [Hkv, G*n, D]: head j = kv j // g, row (j % g, i)
    scores = torch.bmm(qh, k.float().transpose(1, 2)) * scale  # [Hkv, G*n, t]
    if causal:
        seen = torch.arange(t, device=q.device)[None, :] <= torch.arange(t - n, t, device=q.device)[:, None]  # [n, t]
        scores = scores.masked_fill(~seen.repeat(g, 1)[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hkv, G*n]
    out = torch.bmm(torch.exp(scores - lse[..., None]), v.float())  # [Hkv, G*n, D]
    return out.reshape(h, n, d).transpose(0, 1), lse.reshape(h, n)


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over disjoint sets of keys, (out [n, H, D], lse [H, n]) each -> the attention over
    their union [n, H, D] (fp32). Folded part by part: the union so far weighs sigmoid(its lse -
    the next part's), exp(its lse - their union's); five launches a part, where weighting each
    part by exp(its lse - the log-sum-exp of all) took about twenty a layer, and the chunk's
    launches, not the device, set its time (docs/BENCHMARKS.md, a chat's second turn)."""
    out, lse = parts[0][0].float(), parts[0][1]
    for i, (o, x) in enumerate(parts[1:], start=2):
        w = torch.sigmoid(lse - x).transpose(0, 1)[..., None]  # [n, H, 1]: the union so far's weight
        out = torch.lerp(o.float(), out, w)  # o + w (out - o)
        if i < len(parts):
            lse = torch.logaddexp(lse, x)
    return out


def segments_agree(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether `segmented_attention` equals the copying path on `device` (the warm-up's check on
    CUDA, once): a chunk of 37 queries over 3 cached segments, views of a pool as `_segments`
    makes them, and its own keys. False too if a kernel refuses the inputs."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    n, bs = 37, 16
    pool_k, pool_v = rand(kv_heads, 40, bs, head_dim), rand(kv_heads, 40, bs, head_dim)
    runs = ((2, 8), (20, 4), (26, 13))  # (first slot, blocks)
    keys = [pool_k[:, s : s + c].view(kv_heads, c * bs, head_dim) for s, c in runs]
    values = [pool_v[:, s : s + c].view(kv_heads, c * bs, head_dim) for s, c in runs]
    fresh = (rand(n, kv_heads, head_dim), rand(n, kv_heads, head_dim))
    prior = 25 * bs - 10  # (the last block's tail unwritten)
    q, scale = 3 * rand(n, heads, head_dim), head_dim**-0.5  # (peaked: the parts' weights matter)
    try:
        got = segmented_attention(q, keys, values, prior, fresh, scale)
    except RuntimeError:
        return False
    k = torch.cat([torch.cat(keys, dim=1)[:, :prior], fresh[0].transpose(0, 1)], dim=1)
    v = torch.cat([torch.cat(values, dim=1)[:, :prior], fresh[1].transpose(0, 1)], dim=1)
    want = causal_lower_right_attention(q, k, v, scale)
    return bool((got.float() - want.float()).abs().max() <= 0.03 * want.float().abs().max())


WINDOW_TILE = 256  # `window_attention`: queries per SDPA call, at least (a window's worth if larger)


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """A chunk's sliding-window attention: q [n, H, D], the sequence's last n queries over k, v
    [Hkv, T, D] (its first T keys, the chunk's own last) -> [n, H, D]. Query j sits at position
    T - n + j and reads keys p - window < i <= p. Queries go in tiles, each over its band of keys
    only, so the work and the mask grow with n x window, not n x T."""
    n, h, _ = q.shape
    t = k.shape[1]
    q0 = t - n
    step = max(window, WINDOW_TILE)
    outs = []
    for a in range(0, n, step):
        b = min(n, a + step)
        lo, hi = max(0, q0 + a - window + 1), q0 + b
        kpos = torch.arange(lo, hi, device=q.device)
        qpos = torch.arange(q0 + a, q0 + b, device=q.device)[:, None]
        mask = (kpos[None, :] <= qpos) & (kpos[None, :] > qpos - window)  # [b - a, hi - lo]
        part = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None],  # [1, H, m, D]
            k[:, lo:hi].to(q.dtype)[None],
            v[:, lo:hi].to(q.dtype)[None],
            attn_mask=mask,
            scale=scale,
            enable_gqa=h != k.shape[0],
        )  # [1, H, m, D]
        outs.append(part[0].transpose(0, 1))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


GROUP_BYTES = 128 << 20  # `causal_attention`: the largest output one SDPA call writes (by default)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    *,
    group_bytes: int = GROUP_BYTES,
) -> torch.Tensor:
    """A chunk that starts its sequence: causal attention over its own tokens. q: [n, H, D];
    k, v: [n, Hkv, D] -> [n, H, D].

    One torch SDPA call with `is_causal` per group of KV heads (the call transformers makes for a
    whole prompt: flash kernels on CUDA, no mask tensor, GQA without repeated K/V), each group's
    output at most `group_bytes` (one KV head at least), copied into `out` (a new tensor if None).
    `out` may be q itself:
    a group's queries are read before its output is written, and the groups are disjoint, so a long
    prompt needs no second [n, H, D] buffer. On CUDA the math kernel is never taken (its scores
    would be [G, n, n]); where no other kernel takes GQA, a group's K/V are repeated over its
    query heads (one group's copy).
    """
    n, h, d = q.shape
    hkv = k.shape[1]
    per = h // hkv
    res = torch.empty_like(q) if out is None else out
    step = max(1, min(hkv, group_bytes // max(1, n * per * d * q.element_size())))
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, n, D]
    for g in range(0, hkv, step):
        e = min(g + step, hkv)
        qg = q[:, g * per : e * per].transpose(0, 1)[None]  # [1, G, n, D]
        part = causal_sdpa(qg, kt[:, g:e], vt[:, g:e], scale, per, fast_only=q.is_cuda)  # [1, G, n, D]
        res[:, g * per : e * per] = part[0].transpose(0, 1)
    return res


def causal_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, per: int, fast_only: bool
) -> torch.Tensor:
    """SDPA with `is_causal` for q [1, G, n, D] over k, v [1, G / per, n, D]; `fast_only`: never the
    math kernel (CUDA), K/V repeated where no other kernel takes GQA."""
    if not fast_only or per == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=per > 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    try:
        with sdpa_kernel(fast):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    except RuntimeError:  # no fast kernel takes GQA here: repeat this group's K/V
        k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
        with sdpa_kernel(fast):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def causal_lower_right_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk's attention over its sequence's keys. q: [n, H, D]; k, v: [Hkv, T, D] -> [n, H, D].

    The chunk's queries are the sequence's last n tokens, so the causal mask is aligned to the
    lower right. Flash attention's own causal mask is aligned that way when n < T: its kernel is
    called directly, as torch's `causal_lower_right` bias does for these inputs, without importing
    `torch.nn.attention.bias` (which imports torch._dynamo: 3.3 s of the engine thread, on an H100
    host, in the first prefill over a cached prefix after a start). Neither builds the [n, T] mask
    or the [H, n, T] scores (a boolean mask would send SDPA to its math path: 128 GiB of fp32
    scores per layer for 8,192 queries over 131,072 keys). Where flash cannot run (fp32, a head
    size it does not take, an older card), that bias does, through the memory-efficient kernel.
    On CUDA, K and V are repeated over their group's query heads, as those kernels' GQA support
    varies. On a CPU, the boolean mask it stands for: SDPA's CPU kernel accumulates in fp32 and
    reads the keys once per query tile, GQA without repeating K/V."""
    n, h, _ = q.shape
    hkv, t, _ = k.shape
    if not q.is_cuda:
        mask = torch.arange(t, device=q.device)[None, :] <= torch.arange(t - n, t, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.to(q.dtype)[None], v.to(q.dtype)[None], attn_mask=mask, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
        return out[0].transpose(0, 1)  # [n, H, D]
    if h != hkv:
        k, v = k.repeat_interleave(h // hkv, dim=0), v.repeat_interleave(h // hkv, dim=0)
    qb, kb, vb = q.transpose(0, 1)[None], k.to(q.dtype)[None], v.to(q.dtype)[None]  # [1, H, n or T, D]
    if _flash_lower_right(q):
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            qb, kb, vb, 0.0, is_causal=True, return_debug_mask=False, scale=scale
        )[0]
    else:
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=causal_lower_right(n, t), scale=scale)
    return out[0].transpose(0, 1)  # [n, H, D]


def _flash_lower_right(q: torch.Tensor) -> bool:
    """Whether flash attention takes `q` (its dtype, head size and card) for a lower-right chunk."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and _flash_card(q.device.index or 0)
    )


@cache
def _flash_card(index: int) -> bool:
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability(index) >= (8, 0)


def paged_attention(
    q: torch.Tensor, pools: Pools, layer: LayerKV, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Attention for every packed sequence, reading runs in place. q: [N, H, D] -> [N, H, D]
    (`out` may receive a lone prefill chunk's result: see `causal_attention`)."""
    if layer.lists is not None:  # a decode step planned on the device (its runs are not built)
        return reference_attention(q, pools, layer, scale)
    heads = layer.head_locs or (None,) * len(layer.runs)
    alone = len(layer.runs) == 1
    starts = np.cumsum((0, *layer.query_lens)).tolist()

    def one(i: int) -> torch.Tensor:
        n, kv_len, runs, locs = layer.query_lens[i], layer.kv_lens[i], layer.runs[i], heads[i]
        rows = slice(starts[i], starts[i] + n)
        if locs is not None:
            return head_attention(q[rows], pools, locs, kv_len, scale)
        fresh = None if layer.fresh is None else (layer.fresh[0][rows], layer.fresh[1][rows])
        return run_attention(q[rows], pools, runs, kv_len, scale, fresh, out if alone else None, layer.window)

    hkv, d = pools.k[0].shape[0], pools.k[0].shape[-1]
    small = [
        n == 1 and locs is None and hkv * kv_len * d <= SERIAL_ELEMENTS
        for n, kv_len, locs in zip(layer.query_lens, layer.kv_lens, heads, strict=True)
    ]
    outs: list[torch.Tensor | None] = [None] * len(small)
    if any(small):
        with one_thread():
            for i in np.flatnonzero(small).tolist():
                outs[i] = one(i)
    done = [o if o is not None else one(i) for i, o in enumerate(outs)]
    return done[0] if len(done) == 1 else torch.cat(done, dim=0)


class AttentionFn(Protocol):
    """The one signature of every attention path: q [N, H, D] -> [N, H, D]; `out` may receive
    the result (an implementation may ignore it: callers use what is returned)."""

    def __call__(
        self, q: torch.Tensor, pools: Pools, layer: LayerKV, scale: float, out: torch.Tensor | None = None
    ) -> torch.Tensor: ...


class StepKV(Protocol):
    """The KV cache as one forward pass sees it (built by the model runner for each step).

    `write(l, ...)` stores the layer's new K/V; then `layer(l, q, scale)` says which blocks
    attention reads and where: the HBF policy may select a subset for the decode queries `q`, and
    the tier manager may stage blocks (from the SSD archive into DDR) before answering.
    """

    pools: Pools
    seq_ends: torch.Tensor  # [N] int64: each token's sequence length after this pass

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV: ...

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' K/V of layer `index`. k, v: [N, Hkv, D]."""
        ...


def kernel_attention(
    q: torch.Tensor, pools: Pools, layer: LayerKV, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The GPU path: a decode step (one query per sequence) goes to the Triton paged kernel
    (`h3d.kernels.decode`), which reads each listed block where it is, HBM or pinned DDR, with
    no gather, one list per (sequence, KV head); prefill chunks go through `paged_attention` (SDPA
    over the runs). On the CPU the kernel runs only under Triton's interpreter (the tests' twin of
    the GPU path); otherwise its torch fallback computes the same thing. A sliding-window layer's
    decode lists its window's blocks, the window's start inside the first one masked (`head`)."""
    from h3d.kernels.decode import paged_decode

    if not all(n == 1 for n in layer.query_lens):
        return paged_attention(q, pools, layer, scale, out)
    lists = layer.lists if layer.lists is not None else _head_lists(q, pools, layer)
    head = layer.head
    if layer.window is not None:  # kv_lens count the listed tokens: the window is their last `window`
        assert layer.lists is None and layer.head_tables is None, "a sliding-window layer never selects"
        listed = torch.tensor(layer.kv_lens, dtype=torch.int32)
        head = (listed - layer.window).clamp(min=0).to(q.device)
    return paged_decode(q, (pools.k[0], pools.k[1]), (pools.v[0], pools.v[1]), *lists, scale, head=head)
