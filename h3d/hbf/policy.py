"""HBF block selection: which blocks of a layer a decode step's attention reads.

- `exact`: every block (lossless; the oracle).
- `fixed`: `sink_blocks` first blocks + the blocks of the last `recent_tokens` tokens
  (StreamingLLM-like; loses whatever falls between them).
- `layerwise`: sinks + recent + per-layer anchors found during prefill: at each prefill chunk, the
  blocks that draw the most attention mass from the chunk's last `PROBE_QUERIES` queries (the
  last chunk of the prompt has the final word), up to the token budget.
- `attention_entropy` (default): sinks + recent + the top blocks by the digest bound
  (`h3d.hbf.digests.block_scores`) up to `window_tokens`, chosen for each KV head on its own (its
  group of query heads: heads attend to different places, and one shared top-k lets the heads
  with the largest scores crowd out the others' blocks); every `resize_every` decode steps the
  entropy (nats) of the softmax of the block scores resizes the window: below
  `entropy_shrink_below` attention is peaked and the window shrinks, above `entropy_grow_above` it
  is spread and the window grows, within [`window_min_tokens`, `window_max_tokens`].
The first `dense_layers` layers always read every block, as Quest does. Prefill is always exact.

Selection runs where the digests are (the compute device): scores and top-k are tensor ops, and
only the chosen indices come back to the host to build the attention's runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from h3d.hbf.digests import block_scores

PROBE_QUERIES = 64


@dataclass(frozen=True, slots=True)
class HbfConfig:
    """The HBF keys of `h3d.config.EngineConfig` (where their defaults live), as selection reads them."""

    policy: str
    window_tokens: int
    window_min_tokens: int
    window_max_tokens: int
    sink_blocks: int
    recent_tokens: int
    dense_layers: int
    entropy_shrink_below: float
    entropy_grow_above: float
    digest_tokens: int = 8
    resize_every: int = 16


@dataclass(slots=True)
class SelectionState:
    """One session's HBF state (owned by the model runner)."""

    policy: str
    window_tokens: int
    steps: int = 0
    anchors: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> block indices
    entropies: list[float] = field(default_factory=list)


def _base(num_blocks: int, cfg: HbfConfig, block_size: int) -> np.ndarray:
    """Sinks and the recent window (which always holds the last, partial block)."""
    recent = max(1, math.ceil(cfg.recent_tokens / block_size))
    sinks = np.arange(min(cfg.sink_blocks, num_blocks))
    tail = np.arange(max(num_blocks - recent, 0), num_blocks)
    return np.union1d(sinks, tail)


def select(
    state: SelectionState,
    cfg: HbfConfig,
    layer: int,
    q: torch.Tensor,
    digests: torch.Tensor,
    num_blocks: int,
    block_size: int,
    scale: float,
) -> np.ndarray | torch.Tensor | None:
    """Blocks of `layer` to read for query q ([H, D]), ascending: [n] for every KV head (NumPy), or
    [Hkv, n] one row per KV head (attention_entropy: a tensor on q's device, so that a GPU step
    needs no copy to the host); None means all of them."""
    budget = max(1, state.window_tokens // block_size)
    if state.policy == "exact" or layer < cfg.dense_layers or num_blocks <= budget:
        return None
    base = _base(num_blocks, cfg, block_size)
    room = budget - len(base)
    if state.policy == "fixed":
        return base
    if state.policy == "layerwise":
        extra = np.setdiff1d(state.anchors.get(layer, np.empty(0, dtype=np.int64)), base)[:room]
        return np.union1d(base, extra) if room > 0 else base
    scores = block_scores(q, digests, per_head=True)  # [Hkv, nb]
    if layer == cfg.dense_layers:
        _track_entropy(state, scores.amax(dim=0) * scale)  # even with no room left: the window may grow
    if room <= 0:
        return base
    where = torch.from_numpy(base).to(scores.device, non_blocking=True)  # no wait for the stream
    masked = scores.clone()
    masked[:, where] = float("-inf")
    top = torch.topk(masked, min(room, num_blocks - len(base)), dim=-1).indices  # [Hkv, room]
    return torch.cat([where.expand(len(top), -1), top], dim=1).sort(dim=1).values


def _track_entropy(state: SelectionState, logits: torch.Tensor) -> None:
    p = torch.softmax(logits.float(), dim=-1)
    state.entropies.append(float(-(p * torch.log(p.clamp_min(1e-30))).sum()))


def after_step(state: SelectionState, cfg: HbfConfig) -> None:
    """Count a decode step; every `resize_every` steps resize the window from the mean entropy."""
    state.steps += 1
    if state.policy != "attention_entropy" or state.steps % cfg.resize_every or not state.entropies:
        return
    h = sum(state.entropies) / len(state.entropies)
    state.entropies.clear()
    if h < cfg.entropy_shrink_below:
        state.window_tokens = max(cfg.window_min_tokens, state.window_tokens * 3 // 4)
    elif h > cfg.entropy_grow_above:
        state.window_tokens = min(cfg.window_max_tokens, state.window_tokens * 5 // 4)


def probe_anchors(
    state: SelectionState, cfg: HbfConfig, layer: int, q: torch.Tensor, k: torch.Tensor, block_size: int, scale: float
) -> None:
    """Layerwise: record `layer`'s anchors from a prefill chunk.

    q: [n, H, D], the chunk's queries (its last tokens of the sequence); k: [T, Hkv, D], every key
    of the layer so far (the chunk's included). The mass each block draws from the last queries,
    summed over heads and queries, ranks the blocks; the best ones outside sinks and the recent
    window fill the token budget.
    """
    if state.policy != "layerwise" or layer < cfg.dense_layers:
        return
    m = min(PROBE_QUERIES, q.shape[0])
    t, hkv, d = k.shape
    qm = q[-m:].float().view(m, hkv, -1, d)  # [m, Hkv, G, D]
    scores = torch.einsum("mkgd,tkd->kgmt", qm, k.float()) * scale  # [Hkv, G, m, T]
    qpos = torch.arange(t - m, t, device=q.device)
    scores.masked_fill_(torch.arange(t, device=q.device)[None, :] > qpos[:, None], float("-inf"))
    mass = torch.softmax(scores, dim=-1).sum(dim=(0, 1, 2))  # [T]
    nb = -(-t // block_size)
    per_block = torch.zeros(nb * block_size, device=q.device)
    per_block[:t] = mass
    per_block = per_block.view(nb, block_size).sum(-1)  # [nb]
    base = _base(nb, cfg, block_size)
    per_block[torch.from_numpy(base).to(per_block.device)] = float("-inf")
    room = max(0, state.window_tokens // block_size - len(base))
    top = torch.topk(per_block, min(room, nb - len(base))).indices
    state.anchors[layer] = np.sort(top.cpu().numpy())
