"""HBF block selection: which blocks of a layer a decode step's attention reads.

Each policy is an object (`Exact`, `Fixed`, `Layerwise`, `AttentionEntropy`; by name in
`POLICIES`) whose capability flags tell the engine what it needs, so that nothing outside this
module compares policy names:

- `exact`: every block (lossless; the oracle).
- `fixed`: `sink_blocks` first blocks + the blocks of the last `recent_tokens` tokens
  (StreamingLLM-like; loses whatever falls between them).
- `layerwise`: sinks + recent + per-layer anchors found during prefill: at the prompt's last
  prefill chunk, the blocks that draw the most attention mass from its last `PROBE_QUERIES`
  queries, up to the token budget.
- `attention_entropy` (default): sinks + recent + the top blocks by the digest bound
  (`h3d.hbf.digests.block_scores`) up to `window_tokens`, chosen for each KV head on its own (its
  group of query heads: heads attend to different places, and one shared top-k lets the heads
  with the largest scores crowd out the others' blocks). Up to `anchor_share` of the room past
  sinks and recent goes first to the head's prompt anchors: the blocks that drew the most mass of
  that KV head's queries over the prompt's last `PROBE_QUERIES` tokens (the question: SnapKV's
  observation window), recorded at the prompt's last prefill chunk as `layerwise` records its own.
  The digest bound is an upper bound, loose on blocks whose keys spread widely; the prompt's own
  attention finds the blocks a question is about, and the bound keeps the rest of the room for
  what decoding asks. Every `resize_every` decode steps the entropy (nats) of the softmax of the
  block scores resizes the window: below `entropy_shrink_below` attention is peaked and the window
  shrinks, above `entropy_grow_above` it is spread and the window grows, within
  [`window_min_tokens`, `window_max_tokens`].
The first `dense_layers` layers always read every block, as Quest does. Prefill is always exact.

Selection runs where the digests are (the compute device): scores and top-k are tensor ops, and
only the chosen indices come back to the host to build the attention's runs.

What must stay true: sinks and the recent window are always selected; the partial block is the
last one read; `select_static` picks what `select` picks (tests); a session's state written by
`state_to_meta` and read by `state_from_meta` selects as before (a restart keeps it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from h3d.errors import InvalidRequest, clip
from h3d.hbf.digests import Digests, block_scores
from h3d.kernels import probe
from h3d.kernels.copies import to_device

PROBE_QUERIES = 64
PROBE_SCORES_BYTES = 256 << 20  # `probe_anchors`: fp32 scores at once, at most (32K keys of an 8B model: every head)

Selection = np.ndarray | torch.Tensor | None


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
    anchor_share: float = 0.5
    resize_every: int = 16
    # The layer whose block scores give a decode step's entropy (the window's resize): the first
    # full-attention layer past the dense ones (`ModelRunner` sets it from the model); None: the
    # first past the dense ones.
    entropy_layer: int | None = None

    @property
    def entropy_at(self) -> int:
        return self.dense_layers if self.entropy_layer is None else self.entropy_layer


@dataclass(slots=True)
class SelectionState:
    """One session's HBF state (owned by the KV cache, `h3d.kv.cache.KVCache`)."""

    policy: Policy
    window_tokens: int
    steps: int = 0
    # layer -> block indices (`anchors`, which takes in those still on their way from the device)
    anchors_host: dict[int, np.ndarray] = field(default_factory=dict)
    # layer -> (the indices in host memory, the event after which they are there): a prompt's
    # probe (`probe_anchors`) copies them without waiting for the device, so that a prefill's
    # layers are not one host-device round trip each
    anchors_pending: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = field(default_factory=dict)
    # attention_entropy: layer -> [Hkv, n] block indices, best first (on the compute device)
    head_anchors: dict[int, torch.Tensor] = field(default_factory=dict)
    # attention_entropy: each decode step's entropy (nats), as a 0-dim tensor where it was computed
    # (read once per resize, so that a GPU step never waits for it) or a float
    entropies: list[float | torch.Tensor] = field(default_factory=list)
    # attention_entropy: this step's entropy, read by no resize before the step's own (`after_step`
    # moves it into `entropies` after its resize check): a resize reads only the steps before, so
    # that it never waits for the step still running on the device
    current_entropy: float | torch.Tensor | None = None
    anchors_version: int = 0  # bumped whenever the anchors change (a captured step copies them then)
    # layer -> the blocks its last steps read most (`KVCache.note_hot`, at a checkpoint or a close):
    # read ahead first when the session resumes from the archive (`KVCache._known`), a hint only
    hot: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def anchors(self) -> dict[int, np.ndarray]:
        """layer -> the prompt's anchor blocks (sorted), those still being copied from the device
        waited for first."""
        if self.anchors_pending:
            for layer, (host, done) in self.anchors_pending.items():
                if done is not None:
                    done.synchronize()
                self.anchors_host[layer] = np.sort(host.numpy())
            self.anchors_pending.clear()
        return self.anchors_host

    @anchors.setter
    def anchors(self, value: dict[int, np.ndarray]) -> None:
        self.anchors_pending.clear()
        self.anchors_host = value


def state_to_meta(state: SelectionState) -> dict[str, Any]:
    """What a session's token log keeps of its HBF state (JSON), so that a restarted session
    selects as it would have: the window, the step count and the entropies of the current resize
    period. The prompt's anchors (probed at its last chunk) are `anchors_to_meta`'s: large (a
    128K prompt's are some 100,000 block indices), they are written only when they change."""
    return {
        "window_tokens": state.window_tokens,
        "steps": state.steps,
        "entropies": [float(x) for x in state.entropies],
    }


def anchors_to_meta(state: SelectionState) -> dict[str, Any]:
    """The prompt's anchors of `state` (JSON), read back by `state_from_meta`."""
    heads = state.head_anchors
    # one copy to the host for every layer's (device) tensors of one shape, not one sync a layer
    if heads and len({(a.shape, a.device) for a in heads.values()}) == 1:
        rows = torch.stack(list(heads.values())).tolist()
        per_head = {str(layer): row for layer, row in zip(heads, rows, strict=True)}
    else:
        per_head = {str(layer): a.tolist() for layer, a in heads.items()}
    return {"anchors": {str(layer): a.tolist() for layer, a in state.anchors.items()}, "head_anchors": per_head}


def state_from_meta(state: SelectionState, meta: dict[str, Any], device: torch.device) -> None:
    """Restore what `state_to_meta` and `anchors_to_meta` kept into `state` (one dict: missing
    keys keep their values)."""
    state.window_tokens = int(meta.get("window_tokens", state.window_tokens))
    state.steps = int(meta.get("steps", 0))
    state.entropies[:] = [float(x) for x in meta.get("entropies", [])]
    state.anchors = {int(k): np.asarray(v, dtype=np.int64) for k, v in meta.get("anchors", {}).items()}
    state.head_anchors = {
        int(k): torch.tensor(v, dtype=torch.int64, device=device) for k, v in meta.get("head_anchors", {}).items()
    }
    state.anchors_version += 1
    state.hot = {int(k): np.asarray(v, dtype=np.int64) for k, v in meta.get("hot", {}).items()}


def take_state(state: SelectionState, source: SelectionState) -> None:
    """`source`'s HBF state into `state` (a whole fork: the parent's twin selects as it would):
    the policy, window, step count, entropies and the prompt's anchors, copied."""
    state.policy, state.window_tokens, state.steps = source.policy, source.window_tokens, source.steps
    state.entropies[:] = source.entropies  # (floats, or 0-dim tensors never written again)
    state.current_entropy = source.current_entropy
    state.anchors = {layer: a.copy() for layer, a in source.anchors.items()}
    state.head_anchors = {layer: a.clone() for layer, a in source.head_anchors.items()}
    state.hot = dict(source.hot)  # (never written in place)
    state.anchors_version += 1


def hot_to_meta(state: SelectionState) -> dict[str, Any]:
    """The blocks `state`'s last steps read most (JSON), read back by `state_from_meta`."""
    return {"hot": {str(layer): a.tolist() for layer, a in state.hot.items()}}


def base_blocks(num_blocks: int, cfg: HbfConfig, block_size: int) -> np.ndarray:
    """Sinks and the recent window (which always holds the last, partial block): what every
    policy reads and HBF never evicts from HBM."""
    recent = max(1, math.ceil(cfg.recent_tokens / block_size))
    sinks = np.arange(min(cfg.sink_blocks, num_blocks))
    tail = np.arange(max(num_blocks - recent, 0), num_blocks)
    return np.union1d(sinks, tail)


def base_sizes(cfg: HbfConfig, block_size: int) -> tuple[int, int]:
    """(sink blocks, recent blocks) of a context longer than its window: `_base`'s two parts."""
    return cfg.sink_blocks, max(1, math.ceil(cfg.recent_tokens / block_size))


def select_static(
    cfg: HbfConfig,
    q: torch.Tensor,
    digests: torch.Tensor,
    nb: torch.Tensor,
    room: torch.Tensor,
    take: torch.Tensor,
    anchors: torch.Tensor,
    k: int,
    scale: float,
    block_size: int,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """`AttentionEntropy.select` with every shape fixed, for a decode step captured in a CUDA
    graph (`h3d.engine.graphs`): no host value is read, and what changes between steps (the block
    count, the room, the anchors) comes in tensors. Valid where `select` picks (the context is
    longer than the window and there is room past sinks + recent).

    q: [H, D]; digests: [Hkv, W, parts, 2, D], the first W >= nb blocks' (those past nb are
    ignored); nb, room, take: 0-dim int64 tensors (the session's blocks; its room past the base,
    at most nb - base; how many of its anchors come first); anchors: [Hkv, A] block indices, best
    first (padded with 0, a sink); k >= room: the top-k capacity. `entropy` (a 0-dim tensor), when
    given, receives the entropy of this layer's block scores (`_track_entropy`).

    Returns [Hkv, sinks + k + recent] block indices: the sinks, the head's `room` best blocks, the
    recent blocks (the partial last block last); past those `sinks + room + recent` entries,
    padding (to be masked by the list length). The same set per head as `select` (tests).
    """
    sinks, recent = base_sizes(cfg, block_size)
    hkv, w = digests.shape[:2]
    dev = digests.device
    scores = block_scores(q, digests, per_head=True)  # [Hkv, W]
    j = torch.arange(w, device=dev)
    if entropy is not None:
        logits = scores.amax(dim=0).masked_fill(j >= nb, float("-inf")) * scale
        p = torch.softmax(logits.float(), dim=-1)
        entropy.copy_(-(p * torch.log(p.clamp_min(1e-30))).sum())
    masked = scores.clone()
    if anchors.shape[1]:  # the prompt's anchors first: +inf for the first `take` (clamped as `select` does)
        rank = torch.arange(anchors.shape[1], device=dev)
        bonus = torch.where(rank < take, float("inf"), float("-inf")).expand(hkv, -1)
        masked.scatter_reduce_(1, torch.minimum(anchors, nb - 1), bonus, reduce="amax")
    masked.masked_fill_((j < sinks) | (j >= nb - recent), float("-inf"))  # the base, and past the end
    top = torch.topk(masked, min(k, w), dim=-1).indices  # [Hkv, k], best first
    if w < k:  # a table narrower than the capacity (its room is smaller still): padding past it
        top = torch.cat([top, top.new_zeros(hkv, k - w)], dim=1)
    base = torch.arange(sinks + recent, device=dev)
    base = torch.where(base < sinks, base, nb - recent - sinks + base)  # [sinks + recent]
    listed = torch.cat([base[:sinks].expand(hkv, -1), top, base[sinks:].expand(hkv, -1)], dim=1)
    n = sinks + k + recent
    at = torch.arange(n, device=dev)
    at = torch.where(at >= sinks + room, at + (k - room), at).clamp(max=n - 1)  # skip the unused top entries
    return listed.gather(1, at.expand(hkv, -1))


def _track_entropy(state: SelectionState, logits: torch.Tensor) -> None:
    p = torch.softmax(logits.float(), dim=-1)
    record_entropy(state, -(p * torch.log(p.clamp_min(1e-30))).sum(), current=True)  # stays on the device


def record_entropy(state: SelectionState, entropy: float | torch.Tensor, current: bool) -> None:
    """A decode step's entropy for the window's resize: the step under way's (`current`: it counts
    from the next resize on, see `SelectionState.current_entropy`), or an earlier step's (a CUDA
    graph's step, read back from the device during the next step)."""
    if current:
        state.current_entropy = entropy
    else:
        state.entropies.append(entropy)


def probe_anchors(
    state: SelectionState,
    cfg: HbfConfig,
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor | Sequence[torch.Tensor],
    block_size: int,
    scale: float,
) -> None:
    """Record `layer`'s anchors from the chunk that ends a prompt (`layerwise`, `attention_entropy`).

    q: [n, H, D], the chunk's queries (its last tokens of the sequence); k: [Hkv, T, D], every key
    of the layer so far per KV head (the chunk's included), in any dtype, or such keys in segments
    in order ([Hkv, T_i, D] each: the cached prefix's view of the pool, then the chunk's own, never
    concatenated). The mass each block draws from the last queries ranks the blocks, outside sinks
    and the recent window. Summed over heads and queries, the best ones that fill the token budget
    are `layerwise`'s `state.anchors`; per KV head (its group's queries), the best ones that could
    fill the largest window, best first, are `attention_entropy`'s `state.head_anchors` (both
    kept, so that a session may switch). A later prompt's anchors replace these.

    The mass per key: on CUDA `h3d.kernels.probe.key_mass`, which reads the keys in their dtype
    and keeps no scores; elsewhere its twin here, which scores in fp32, as many KV heads at once
    as `PROBE_SCORES_BYTES` of scores hold.
    """
    if not state.policy.probes_prompt or layer < cfg.dense_layers:
        return
    segments = [k] if isinstance(k, torch.Tensor) else list(k)
    m = min(PROBE_QUERIES, q.shape[0])
    hkv, d = segments[0].shape[0], segments[0].shape[2]
    t = sum(s.shape[1] for s in segments)
    kernels = probe.applies(q.device)
    if kernels and q.dtype == segments[0].dtype:
        qm = (q[-m:] * scale).view(m, hkv, -1, d)  # (the product in fp32 rounded once: what the kernels would round)
    else:
        qm = (q[-m:].float() * scale).view(m, hkv, -1, d)  # [m, Hkv, G, D]
    g = qm.shape[2]
    qh = qm.permute(1, 0, 2, 3).reshape(hkv, m * g, d)  # [Hkv, m * G, D], rows (query, head)
    nb = -(-t // block_size)
    per_key = torch.zeros(hkv, nb * block_size, device=q.device)
    if kernels:
        probe.key_mass(qh, segments, m, g, out=per_key[:, :t])  # (written in place)
    else:
        keys = segments[0] if len(segments) == 1 else torch.cat([s.float() for s in segments], dim=1)
        last = torch.arange(m, device=q.device)
        # [m * G, m]: the last m keys after each query
        late = (last[None, :] > last[:, None]).repeat_interleave(g, dim=0)
        heads = max(1, PROBE_SCORES_BYTES // (m * g * t * 4))  # KV heads scored at once
        for h in range(0, hkv, heads):
            scores = torch.bmm(qh[h : h + heads], keys[h : h + heads].float().transpose(1, 2))  # [h, m * G, T]
            scores[:, :, t - m :].masked_fill_(late, float("-inf"))  # causal: only the last m keys can be later
            per_key[h : h + heads, :t] = torch.softmax(scores, dim=-1).sum(dim=1)  # mass per key
    per_block = per_key.view(hkv, nb, block_size).sum(-1)  # [Hkv, nb]
    base = base_blocks(nb, cfg, block_size)
    # (index_fill_: a scalar value set through indexing is a host tensor copied with a stream sync)
    per_block.index_fill_(1, to_device(base, per_block.device), float("-inf"))
    most = max(0, cfg.window_max_tokens // block_size - len(base))
    state.head_anchors[layer] = torch.topk(per_block, min(most, nb - len(base)), dim=-1).indices
    state.anchors_version += 1
    room = max(0, state.window_tokens // block_size - len(base))
    top = torch.topk(per_block.sum(0), min(room, nb - len(base))).indices
    done = None
    if top.device.type == "cuda":  # copied behind the device's queue: no wait here (see `anchors`)
        host = torch.empty(top.shape, dtype=top.dtype, pin_memory=True)
        host.copy_(top, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        top = host
    state.anchors_host.pop(layer, None)
    state.anchors_pending[layer] = (top, done)


@dataclass(frozen=True, slots=True)
class Window:
    """One layer's selection of a context longer than its window: the query and what it is
    scored against, and the room the window leaves past the base."""

    layer: int
    q: torch.Tensor  # [H, D] the decode token's queries
    digests: Digests  # [Hkv, nb, parts, 2, D] (`DigestStore.get`)
    num_blocks: int
    scale: float
    base: np.ndarray  # sinks and the recent window (`base_blocks`)
    room: int  # blocks the window leaves past the base (<= 0: none)


class Policy:
    """A selection policy: stateless (one instance per policy, `POLICIES`); a session's state is
    its `SelectionState`. The flags say what the engine keeps and runs for it."""

    name: ClassVar[str]
    selects: ClassVar[bool] = True  # reads a subset of a long context's blocks (else every block)
    keeps_digests: ClassVar[bool] = True  # digests kept as keys are written (else built on a switch)
    probes_prompt: ClassVar[bool] = False  # records anchors from the chunk that ends a prompt
    graphable: ClassVar[bool] = False  # its decode steps may be replayed as CUDA graphs (selecting inside)
    resizes_window: ClassVar[bool] = False  # the window follows the attention's entropy

    def __repr__(self) -> str:
        return f"<policy {self.name}>"

    def select(
        self,
        state: SelectionState,
        cfg: HbfConfig,
        layer: int,
        q: torch.Tensor,
        digests: Digests,
        num_blocks: int,
        block_size: int,
        scale: float,
    ) -> Selection:
        """Blocks of `layer` to read for query q ([H, D]), ascending: [n] for every KV head (NumPy),
        or [Hkv, n] one row per KV head (a tensor on q's device, so that a GPU step needs no copy
        to the host); None means all of them."""
        budget = max(1, state.window_tokens // block_size)
        if not self.selects or layer < cfg.dense_layers or num_blocks <= budget:
            return None
        base = base_blocks(num_blocks, cfg, block_size)
        return self._pick(state, cfg, Window(layer, q, digests, num_blocks, scale, base, budget - len(base)))

    def _pick(self, state: SelectionState, cfg: HbfConfig, w: Window) -> Selection:
        """The selection of a context longer than its window (`w`)."""
        return w.base

    def known(
        self, state: SelectionState, cfg: HbfConfig, layer: int, num_blocks: int, block_size: int
    ) -> np.ndarray | None:
        """The blocks of `layer` that the next decode step reads whatever its query (ascending;
        None: every block), so that a resumed session reads them ahead (`h3d.tiers.readahead`)."""
        budget = max(1, state.window_tokens // block_size)
        if not self.selects or layer < cfg.dense_layers or num_blocks <= budget:
            return None
        base = base_blocks(num_blocks, cfg, block_size)
        return self._known(state, cfg, layer, num_blocks, base, budget - len(base))

    def _known(
        self, state: SelectionState, cfg: HbfConfig, layer: int, num_blocks: int, base: np.ndarray, room: int
    ) -> np.ndarray:
        return base

    def after_step(self, state: SelectionState, cfg: HbfConfig) -> None:
        """Count a decode step of a session under this policy."""
        state.steps += 1
        state.current_entropy = None


class Exact(Policy):
    name = "exact"
    selects = False
    keeps_digests = False
    graphable = True


class Fixed(Policy):
    name = "fixed"


class Layerwise(Policy):
    name = "layerwise"
    probes_prompt = True

    def _pick(self, state: SelectionState, cfg: HbfConfig, w: Window) -> Selection:
        extra = np.setdiff1d(state.anchors.get(w.layer, np.empty(0, dtype=np.int64)), w.base)[: w.room]
        return np.union1d(w.base, extra) if w.room > 0 else w.base

    def _known(
        self, state: SelectionState, cfg: HbfConfig, layer: int, num_blocks: int, base: np.ndarray, room: int
    ) -> np.ndarray:
        extra = np.setdiff1d(state.anchors.get(layer, np.empty(0, dtype=np.int64)), base)[:room]
        return np.union1d(base, extra) if room > 0 else base


class AttentionEntropy(Policy):
    name = "attention_entropy"
    probes_prompt = True
    graphable = True
    resizes_window = True

    def _pick(self, state: SelectionState, cfg: HbfConfig, w: Window) -> Selection:
        scores = block_scores(w.q, w.digests, per_head=True)  # [Hkv, nb]
        if w.layer == cfg.entropy_at:
            _track_entropy(state, scores.amax(dim=0) * w.scale)  # even with no room left: the window may grow
        if w.room <= 0:
            return w.base
        where = to_device(w.base, scores.device)  # no wait for the stream
        masked = scores.clone()
        anchors = state.head_anchors.get(w.layer)
        take = min(int(w.room * cfg.anchor_share), anchors.shape[1]) if anchors is not None else 0
        if anchors is not None and take:  # the prompt's anchors first (past a rewind some may lie past the end)
            masked.scatter_(1, anchors[:, :take].clamp(max=w.num_blocks - 1), float("inf"))
        masked[:, where] = float("-inf")
        top = torch.topk(masked, min(w.room, w.num_blocks - len(w.base)), dim=-1).indices  # [Hkv, room]
        return torch.cat([where.expand(len(top), -1), top], dim=1).sort(dim=1).values

    def _known(
        self, state: SelectionState, cfg: HbfConfig, layer: int, num_blocks: int, base: np.ndarray, room: int
    ) -> np.ndarray:
        """The base and every head's anchors that come first (what `_pick` marks +inf)."""
        anchors = state.head_anchors.get(layer)
        if room <= 0 or anchors is None:
            return base
        take = min(int(room * cfg.anchor_share), anchors.shape[1])
        first = anchors[:, :take].clamp(max=num_blocks - 1).cpu().numpy().ravel()
        return np.union1d(base, first)

    def after_step(self, state: SelectionState, cfg: HbfConfig) -> None:
        """Count a decode step; every `resize_every` steps resize the window from the mean entropy
        of the steps before this one (this step's joins the next period: reading it could make the
        host wait for the device)."""
        state.steps += 1
        if state.steps % cfg.resize_every == 0 and state.entropies:
            h = float(sum(state.entropies)) / len(state.entropies)  # values of finished steps only
            state.entropies.clear()
            if h < cfg.entropy_shrink_below:
                state.window_tokens = max(cfg.window_min_tokens, state.window_tokens * 3 // 4)
            elif h > cfg.entropy_grow_above:
                state.window_tokens = min(cfg.window_max_tokens, state.window_tokens * 5 // 4)
        if state.current_entropy is not None:
            state.entropies.append(state.current_entropy)
            state.current_entropy = None


POLICIES: dict[str, Policy] = {p.name: p for p in (AttentionEntropy(), Exact(), Fixed(), Layerwise())}


def policy_named(name: str) -> Policy:
    """The policy called `name`; `InvalidRequest` naming the known ones for any other."""
    policy = POLICIES.get(name)
    if policy is None:
        raise InvalidRequest(f"unknown policy {clip(name)!r} (known: {', '.join(POLICIES)})")
    return policy
