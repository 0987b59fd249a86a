"""Attention over the paged KV cache.

Two implementations with one signature (`AttentionFn`):

- `reference_attention`: gather every block named in the block tables, softmax in fp32. The
  oracle that every faster path is compared with (a padded table reads the zero null slot, masked).
- `paged_attention`: the CPU fast path. A sequence's blocks of one layer mostly sit in consecutive
  slots (see `h3d.kv.blocks`), so a decode step reads each run of consecutive slots in place as a
  strided view (no gather copy), concatenates the runs' scores, and sums the runs'
  probability-weighted values; a prefill chunk goes through torch SDPA over the same views.
  Sequences whose blocks are scattered into more than `MAX_RUNS` runs are gathered first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

MAX_RUNS = 8
Runs = list[tuple[int, int]]  # (first slot, number of consecutive slots)


@dataclass(frozen=True, slots=True)
class AttentionBatch:
    """What one forward pass's attention needs; built by the model runner for each step.

    Sequences are packed along one token axis: sequence i owns `query_lens[i]` consecutive rows of
    q. Its keys are the first `kv_lens[i]` tokens of its blocks (the new tokens included).
    """

    query_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    write_rows: torch.Tensor  # [L, N] int64 pool rows of the new tokens' K/V
    block_tables: torch.Tensor  # [L, B, W] int64 slot ids, NULL_SLOT padded
    kv_lens_t: torch.Tensor  # [B] int64
    seq_ends: torch.Tensor  # [N] int64: each token's sequence length after this pass
    runs: tuple[list[Runs], ...]  # [B][L]: each sequence's blocks per layer as runs of slots

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def _gather(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """pool: [Hkv, S, bs, D]; table: [..., W] -> [..., W*bs, Hkv, D]."""
    g = pool[:, table]  # [Hkv, ..., W, bs, D]
    return g.reshape(pool.shape[0], *table.shape[:-1], -1, pool.shape[-1]).movedim(0, -2)


def decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence. q: [B, H, D]; tables: [B, W]; kv_lens: [B] -> [B, H, D]."""
    b, h, d = q.shape
    k = _gather(k_pool, tables).float()  # [B, T, Hkv, D]
    v = _gather(v_pool, tables).float()  # [B, T, Hkv, D]
    hkv = k.shape[2]
    qg = q.float().view(b, hkv, h // hkv, d)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,btkd->bkgt", qg, k) * scale  # [B, Hkv, G, T]
    t = torch.arange(k.shape[1], device=q.device)
    scores.masked_fill_((t[None, :] >= kv_lens[:, None])[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgt,btkd->bkgd", probs, v)  # [B, Hkv, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def prefill_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor, kv_len: int, scale: float
) -> torch.Tensor:
    """A chunk of one sequence's queries, causal. q: [n, H, D]; table: [W] -> [n, H, D].

    The n queries are the sequence's last n tokens: query j sits at position kv_len - n + j and
    sees keys 0..that position.
    """
    n, h, d = q.shape
    k = _gather(k_pool, table)[:kv_len].float()  # [T, Hkv, D]
    v = _gather(v_pool, table)[:kv_len].float()  # [T, Hkv, D]
    hkv = k.shape[1]
    qg = q.float().view(n, hkv, h // hkv, d)  # [n, Hkv, G, D]
    scores = torch.einsum("nkgd,tkd->kgnt", qg, k) * scale  # [Hkv, G, n, T]
    qpos = torch.arange(kv_len - n, kv_len, device=q.device)
    kpos = torch.arange(kv_len, device=q.device)
    scores.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("kgnt,tkd->nkgd", probs, v)  # [n, Hkv, G, D]
    return out.reshape(n, h, d).to(q.dtype)


def reference_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch, layer: int, scale: float
) -> torch.Tensor:
    """Attention for every packed sequence of `batch` at `layer`, by gathering. q: [N, H, D] -> [N, H, D]."""
    tables = batch.block_tables[layer]  # [B, W]
    if batch.decode_only:
        return decode_attention(q, k_pool, v_pool, tables, batch.kv_lens_t, scale)
    outs = []
    start = 0
    for i, (n, kv_len) in enumerate(zip(batch.query_lens, batch.kv_lens, strict=True)):
        outs.append(prefill_attention(q[start : start + n], k_pool, v_pool, tables[i], kv_len, scale))
        start += n
    return torch.cat(outs, dim=0)


def _segments(pool: torch.Tensor, runs: Runs) -> list[torch.Tensor]:
    """Views of `pool` ([Hkv, S, bs, D]) for each run, [Hkv, t, D] each: every head's keys of a
    run are one contiguous matrix. One gathered tensor instead if the runs are many."""
    hkv, _, bs, d = pool.shape
    if len(runs) > MAX_RUNS:
        slots = np.concatenate([np.arange(s, s + c) for s, c in runs])
        return [pool[:, torch.from_numpy(slots).to(pool.device)].view(hkv, -1, d)]
    return [pool[:, s : s + c].view(hkv, c * bs, d) for s, c in runs]


def run_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, runs: Runs, kv_len: int, scale: float
) -> torch.Tensor:
    """One sequence's last n queries over its blocks read in place. q: [n, H, D] -> [n, H, D]."""
    n, h, d = q.shape
    hkv = k_pool.shape[0]
    if n > 1:
        return _chunk_attention(q, k_pool, v_pool, runs, kv_len, scale)
    # One query: every KV head's group of queries in one bmm per run, keys read in place.
    g = h // hkv
    qh = q.float().view(hkv, g, d) * scale  # [Hkv, G, D]
    keys = _segments(k_pool, runs)
    scores = torch.cat([torch.bmm(qh, k.transpose(1, 2).float()) for k in keys], dim=-1)  # [Hkv, G, T]
    # The tail of the last block past kv_len is unwritten: dropped, not masked.
    probs = torch.softmax(scores[..., :kv_len], dim=-1)
    out: torch.Tensor | None = None
    offset = 0
    for v in _segments(v_pool, runs):
        t = min(v.shape[1], kv_len - offset)
        part = torch.bmm(probs[..., offset : offset + t], v[:, :t].float())  # [Hkv, G, D]
        out = part if out is None else out + part
        offset += t
    assert out is not None
    return out.reshape(1, h, d).to(q.dtype)


def _chunk_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, runs: Runs, kv_len: int, scale: float
) -> torch.Tensor:
    """A prefill chunk (n > 1 queries): torch SDPA over the runs (views, or one copy if several).

    SDPA's CPU kernel accumulates in fp32 and reads the keys once per query tile, about 3x faster
    than materializing the [n, T] scores here; the boolean mask is causal and hides the unwritten
    tail of the last block.
    """
    n = q.shape[0]
    keys, values = _segments(k_pool, runs), _segments(v_pool, runs)
    k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=1)  # [Hkv, T, D]
    v = values[0] if len(values) == 1 else torch.cat(values, dim=1)  # [Hkv, T, D]
    kpos = torch.arange(k.shape[1], device=q.device)
    qpos = torch.arange(kv_len - n, kv_len, device=q.device)
    mask = kpos[None, :] <= qpos[:, None]  # [n, T]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, n, D]
        k[None],  # [1, Hkv, T, D]
        v[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )  # [1, H, n, D]
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch, layer: int, scale: float
) -> torch.Tensor:
    """Attention for every packed sequence of `batch` at `layer`, reading runs in place."""
    outs = []
    start = 0
    for n, kv_len, runs in zip(batch.query_lens, batch.kv_lens, batch.runs, strict=True):
        outs.append(run_attention(q[start : start + n], k_pool, v_pool, runs[layer], kv_len, scale))
        start += n
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionBatch, int, float], torch.Tensor]
