"""Decode steps replayed as CUDA graphs: the whole forward of a decode step is one launch.

A decode step of a Llama-8B shape issues a few hundred kernels (32 layers of norms, projections,
RoPE, the cache write, the paged attention kernel and its merge, the MLP); launched one by one from
Python they cost more host time than the GPU needs for them. `DecodeGraphs` captures the forward
once per `GraphKey` and replays it. The key is shapes only, never sessions:

- the batch padded to a power of two (`batch_bucket`);
- the block-table width rounded up to a quarter of a power of two (`width_bucket`);
- the selection capacity `k` of the slots under `attention_entropy` (their largest room past
  sinks + recent, rounded up to a power of two: `room_bucket`; 0 when no slot selects);
- `mixed`: some slot that does not select reads whole tables beside selecting ones (the attention
  kernel's lists are then a table wide, not `sinks + k + recent`).

A graph reads its sessions only through static buffers indexed by batch slot (`StaticInputs`,
named views of one pinned host tensor and its device copy); between steps the host writes each
slot's values there, so any batch of sessions of the same shape replays the same graph:

- `tables["locs"]` [L, B, W] int32: every layer's block locations (HBM slot, or -(DDR slot + 1):
  the kernel reads pinned DDR in place), copied only when some slot's table changed (another
  session in the slot, a new block, a move between tiers);
- `small` int64, copied every step (a few hundred bytes): `rows` [L, B] (the new tokens' cache
  rows), and per slot `nblocks`, `tail` (the last block's fill), `token`, `pos`, `ends`, and for
  selection `room` (0: the slot does not select), `take` (anchors first), `parts_live`,
  `dig_base` (the slot's extent in the digest arena) and `dig_row` (the arena row its new key
  folds into);
- `_Hbf.anchors` [Ls, B, Hkv, A]: each slot's prompt anchors, copied when the slot's session or
  its anchors changed.

Selecting slots select inside the graph, through the kernels of `h3d.kernels.select` (their torch
twin, `h3d.hbf.policy.select_static`, where Triton cannot run): for each sparse layer the digest
bound of every slot in one launch (reading the digest arena, `h3d.hbf.digests`, at each slot's
base row), its prompt anchors first, each head's best blocks up to `k` (each slot its own room),
and the attention kernel's per-head lists gathered from `locs`; the new key is folded into its
digest and the first sparse layer's entropy written to a buffer. The blocks the heads read come
back to the host after the step as one byte per layer, slot and block (`_code_picks`: how many
heads read it, and whether from below HBM where the step read it; `resolve`: an asynchronous
copy), and are promoted during the next step (`take_lagged`), so that the host's planning
overlaps the device's work; their reads are counted against the locations the step read.

The selection capacity `k` is one per runner (`capacity`: the room of the widest window,
`window_max_tokens / block_size` less sinks and recent, rounded up to a power of two): each slot
selects its own room (`room` <= `k`) and the attention kernel reads only its lists' first
`sinks + room + recent` entries, so an adaptive window that grows or shrinks never needs another
graph. How many graphs: batch buckets (log2 of `max_batch_size`, + 1) x width buckets (four per
doubling of the longest context, from 16 blocks) x (exact, selecting, mixed). With the defaults (64
slots) and contexts up to 128K: 7 x 33 x 3 reachable keys, of which at most `MAX_GRAPHS` are kept
beyond the warm set (the least recently used are dropped). What each holds: its static buffers
(`nbytes`; for 32 slots of a 128K-token Llama-8B, W = 4,096 and capacity 256: `locs` 17 MB on the
host and 17 on the device, `anchors` 15 MB, `picked` 16 MB and `codes` 4 MB on the device,
`codes`' host copy 4 MB) and the intermediates of its forward, in one memory pool that all graphs share (they never
run at once). A graph whose digest arena was replaced since its capture (the arena grew past the
rows reserved for the tiers' blocks) is captured again.

The warm set (`warm_set`, `warm`): one session's graphs at every width up to the longest context
(batch 1: exact at every width, selecting at every width past the narrowest window), each
captured from padding inputs, before the daemon says it is ready (`graphs_before_ready`) or, by
default, after: they wait in `deferred` and the idle engine captures one per turn, the ones steps
wanted first. From then on
(`deferring`) a step whose graph is not captured runs that graph's forward uncaptured (its static
buffers and the batch's selection kernels, each launched: what a CPU runs) and its key waits in
`deferred`; the engine captures waiting graphs between steps (`capture_deferred`: when it idles,
or one per step once a key has run `DEFER_STEPS` (2) steps uncaptured), counted in
`captures_after_ready` (`h3d_graph_captures_total` counts all). An uncaptured step costs the
launches a replay saves (milliseconds); the eager path it replaced planned each session's
selection on its own, 1.0-1.9 s a step for 32 sessions of 32K on the H200 (docs/BENCHMARKS.md).

Padding slots feed token 0 at position 0, write into the null slot (row 0, never read: lists mask
it) and attend to that one token; their outputs are dropped.

When it applies (`applies`): every chunk is one decode token, every session is under `exact`, or
under `attention_entropy` with a context longer than its window (and room past sinks + recent),
and every block is in HBM or DDR (none to stage from the archive). Anything else runs eagerly
(`h3d.engine.stepkv`).

No host synchronization inside a step: the inputs' copies are asynchronous (pinned staging), and
the staging buffers are rewritten only after the previous step's copy has completed (an event).

On the CPU (tests) the same static-buffer forward runs eagerly, without capture: buckets, padding,
table caching and the cache writes are the GPU path's, only the replay differs.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from h3d.engine.step import Reads
from h3d.hbf.policy import base_sizes, record_entropy, select_static
from h3d.kernels import loader, select
from h3d.kernels.copies import paged_write
from h3d.kv.attention import LayerKV, Pools, kernel_attention, window_lists
from h3d.kv.blocks import BlockTable, SeqId

if TYPE_CHECKING:
    from h3d.engine.runner import ModelRunner
    from h3d.engine.step import StepPlan, StepReport

MAX_BATCH = 256
MAX_GRAPHS = 32  # least recently used graphs beyond the warm set and this many are dropped
# Uncaptured steps after which a busy engine captures a waiting graph between steps: each pays
# the launches a replay saves, and a capture costs one stall (0.4-0.5 s for 32 sessions of 32K on
# the H200, docs/BENCHMARKS.md; those sessions' steps ran eagerly then, at 1.0-1.9 s each).
DEFER_STEPS = 2
SLOT_INPUTS = (
    "nblocks", "tail", "token", "pos", "ends", "room", "take", "parts_live",
    "dig_base", "dig_row", "dig_src", "dig_shared",
)  # fmt: skip


def _pad(x: dict[str, np.ndarray], b: int) -> None:
    """Slots from `b` on as padding (token 0 at position 0, written into the null slot), and no
    slot selecting (the null extent): the host's side of the small buffer before a step fills
    its `b` sessions' slots."""
    x["rows"][:, b:] = 0
    for name, pad in (("nblocks", 1), ("tail", 1), ("token", 0), ("pos", 0), ("ends", 1)):
        x[name][b:] = pad
    for name in ("room", "take", "parts_live", "dig_base", "dig_row", "dig_src", "dig_shared"):
        x[name][:] = 0


def batch_bucket(b: int) -> int:
    """The batch size a step of b sequences is padded to: the next power of two."""
    return 1 << max(0, (b - 1).bit_length())


def width_bucket(blocks: int) -> int:
    """The table width for `blocks` blocks: a multiple of a quarter of the power of two below it (at
    most 25 % padding, four graphs per doubling of the context), at least 16."""
    if blocks <= 16:
        return 16
    quarter = 1 << max(0, (blocks - 1).bit_length() - 3)
    return -(-blocks // quarter) * quarter


def room_bucket(room: int) -> int:
    """The top-k capacity of a captured HBF selection: the next power of two, at least 8."""
    return max(8, 1 << max(0, (room - 1).bit_length()))


@dataclass(frozen=True, slots=True)
class GraphKey:
    """What a captured step depends on: shapes, never sessions (see the module docstring)."""

    batch: int
    width: int
    k: int = 0  # selection capacity; 0: no slot selects
    mixed: bool = False  # with k: some slot that does not select reads its whole table


class StaticInputs:
    """Named static buffers of one dtype: each a view of one packed host tensor (pinned on CUDA)
    and of its device copy, so that a step's inputs reach the device in one copy (`upload`)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device, pin: bool):
        total = sum(math.prod(shape) for shape in shapes.values())
        self._host = torch.zeros(total, dtype=dtype, pin_memory=pin)
        self._device = self._host.to(device, copy=True)
        self.host: dict[str, np.ndarray] = {}  # the host's views (numpy, written between steps)
        self.device: dict[str, torch.Tensor] = {}  # the graph's views
        at = 0
        for name, shape in shapes.items():
            size = math.prod(shape)
            self.host[name] = self._host[at : at + size].numpy().reshape(shape)
            self.device[name] = self._device[at : at + size].view(shape)
            at += size

    def upload(self, non_blocking: bool) -> None:
        self._device.copy_(self._host, non_blocking=non_blocking)

    @property
    def nbytes(self) -> int:
        return 2 * self._host.numel() * self._host.element_size()


@dataclass(slots=True)
class _Hbf:
    """A selecting graph's own buffers: per slot, inputs copied when the slot's session changes,
    outputs read after the step, and the lists the attention kernel reads."""

    k: int  # top-k capacity
    anchors: torch.Tensor  # [Ls, B, Hkv, A] int64: each sparse layer's prompt anchors (0 pads: a sink)
    picked: torch.Tensor  # [Ls, B, Hkv, n] int64: the blocks each head read
    # [Ls, B, W] uint8, the step's output for promotion: per block, how many KV heads read it (low 7
    # bits) and whether it was read from below HBM (the high bit) (`_code_picks`)
    codes: torch.Tensor
    entropy: torch.Tensor  # [B] fp32: the first sparse layer's block-score entropy (output)
    heads: torch.Tensor  # [B, Hkv, NW] int32: the kernels' lists (NW: n, or max(n, W) when mixed)
    nblocks: torch.Tensor  # [B, Hkv] int32: their lengths
    anchored: list[tuple[SeqId, int] | None]  # per slot: (session, anchors_version) in `anchors`
    # Where `codes` and `entropy` are copied after a step (pinned on CUDA: made with the graph, as
    # pinning host memory on a step's path can wait for the device)
    codes_host: torch.Tensor
    entropy_host: torch.Tensor

    @property
    def nbytes(self) -> int:
        own = (self.anchors, self.picked, self.codes, self.heads, self.nblocks)
        return sum(t.numel() * t.element_size() for t in own) + self.codes.numel()  # + codes' host copy


@dataclass(frozen=True, slots=True)
class _Pending:
    """A replayed step's HBF picks on their way to the host (see `DecodeGraphs.resolve`)."""

    seqs: tuple[SeqId, ...]
    slots: tuple[int, ...]  # each session's batch slot
    codes: torch.Tensor  # [Ls, B, W] host copy of `_Hbf.codes` (pinned on CUDA)
    entropy: torch.Tensor  # [B] host copy of the slots' entropies
    done: torch.cuda.Event | None  # the copies' completion (CUDA)
    lagged: bool  # read during the next step (its reads counted then), else right after its own


@dataclass(slots=True)
class _Graph:
    """One key's static buffers, and its captured graph (None on the CPU)."""

    key: GraphKey
    small: StaticInputs  # int64, every step: "rows" [L, B] and SLOT_INPUTS [B]
    tables: StaticInputs  # int32, when a table changed: "locs" [L, B, W]
    hbf: _Hbf | None = None
    hidden: torch.Tensor | None = None  # the forward's output [B, hidden] (static under a graph)
    graph: torch.cuda.CUDAGraph | None = None
    generation: int = -1  # the digest arena's generation the graph was captured against
    # per slot, what `locs` holds: (session, table version, blocks, whether it selects)
    slots: list[tuple[SeqId, int, int, bool]] = field(default_factory=list)
    below: list[int] = field(default_factory=list)  # per slot: its blocks in DDR (the layers it reads whole)
    whole: list[int] = field(default_factory=list)  # per slot: the blocks of the layers it reads whole
    selecting: tuple[tuple[int, SeqId, int], ...] = ()  # this step's (slot, session, room) that select
    copied: torch.cuda.Event | None = None  # the last input copy (the staging is reused after it)

    @property
    def nbytes(self) -> int:
        """The static buffers' bytes (host and device); the forward's intermediates are in the shared pool."""
        return self.small.nbytes + self.tables.nbytes + (self.hbf.nbytes if self.hbf is not None else 0)


class _GraphKV:
    """The static-buffer view of the KV cache for one decode step (a `StepKV`)."""

    def __init__(self, pools: Pools, runner: ModelRunner, g: _Graph) -> None:
        hkv = runner.hbm.k.shape[0]
        inputs = g.small.device
        self.pools = pools
        self.runner = runner
        self.g = g
        self.inputs = inputs
        self.rows = inputs["rows"]  # [L, B]
        self.seq_ends = inputs["ends"]
        self.nblocks = inputs["nblocks"].to(torch.int32)[:, None].expand(-1, hkv)  # [B, Hkv]
        self.tail = inputs["tail"].to(torch.int32)
        self.locs = g.tables.device["locs"]  # [L, B, W]
        self.hkv = hkv
        self.query_lens = (1,) * g.key.batch
        self.block_size = runner.blocks.block_size

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        table = self.locs[index]  # [B, W]
        window = self.runner.windows[index]
        head = None
        if window is not None:  # a sliding-window layer: its window's blocks, whatever the policy
            lists, head = window_lists(table, self.inputs["nblocks"], self.tail, window, self.block_size, self.hkv)
        elif self.g.hbf is None or index < self.runner.hbf.dense_layers:
            lists = (table[:, None, :].expand(-1, self.hkv, -1), self.nblocks, self.tail)
        elif select.available(table.device):
            lists = self._select_kernels(index, q, scale, table)
        else:
            lists = self._select_torch(index, q, scale, table)
        return LayerKV(
            query_lens=self.query_lens,
            kv_lens=self.query_lens,  # not read: attention reads `lists`
            runs=tuple([] for _ in self.query_lens),
            tables=lambda: table,
            lists=lists,
            head=head,
        )

    def _select_kernels(self, index: int, q: torch.Tensor, scale: float, table: torch.Tensor) -> tuple:
        """Every slot's lists from the selection kernels (`h3d.kernels.select`): the masked
        bounds, one top-k and one list kernel, each one launch for the batch; the first sparse
        layer's entropy from the raw bounds. Slots that do not select (room 0) list their tables."""
        r, hb, x = self.runner, self.g.hbf, self.inputs
        assert hb is not None
        dense = r.hbf.dense_layers
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        b, w = table.shape
        masked = torch.empty((b, self.hkv, w), dtype=torch.float32, device=q.device)
        raw = torch.empty_like(masked) if index == r.hbf.entropy_at else None
        select.scores(
            masked, q, r.digests.arena(index), r.digests.parts, x["dig_base"], x["nblocks"], x["parts_live"],
            x["take"], hb.anchors[index - dense], sinks, recent, raw, (x["dig_src"], x["dig_shared"]),
        )  # fmt: skip
        if raw is not None:
            self._entropy(raw.amax(dim=1), scale)
        top = select.top_room(masked, x["room"], hb.k)  # [B, Hkv, k]
        select.lists(top, table, x["nblocks"], x["room"], hb.heads, hb.nblocks, hb.picked[index - dense], sinks, recent)
        return hb.heads, hb.nblocks, self.tail

    def _entropy(self, bound: torch.Tensor, scale: float) -> None:
        """Each slot's entropy of its block scores [B, W] (-inf past its blocks; a slot that does
        not select has no finite score and gets 0)."""
        hb = self.g.hbf
        assert hb is not None
        p = torch.softmax(bound * scale, dim=-1).nan_to_num(0.0)
        hb.entropy.copy_(-(p * torch.log(p.clamp_min(1e-30))).sum(dim=-1))

    def _select_torch(self, index: int, q: torch.Tensor, scale: float, table: torch.Tensor) -> tuple:
        """The kernels' twin (a CPU without Triton's interpreter): `select_static` for each slot,
        its lists gathered from the table, or its whole table where the slot does not select (no
        host value is read: a slot's choice is a `where`; what a slot that does not select
        computes, entropy included, is never read)."""
        r, hb, x = self.runner, self.g.hbf, self.inputs
        assert hb is not None
        dense = r.hbf.dense_layers
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        n = sinks + hb.k + recent
        b, w = table.shape
        nw = hb.heads.shape[2]
        arena, parts = r.digests.arena(index), r.digests.parts  # [Hkv, rows, 2, D]
        span = torch.arange(w * parts, device=table.device)
        whole = torch.zeros((b, nw), dtype=table.dtype, device=table.device)
        whole[:, : min(w, nw)] = table[:, :nw]
        for i in range(b):
            rows = torch.where(span < x["dig_shared"][i], x["dig_src"][i] + span, x["dig_base"][i] + span)
            rows = rows.clamp(0, arena.shape[1] - 1)
            digests = arena.index_select(1, rows).view(self.hkv, w, parts, 2, -1)
            blocks = select_static(
                r.hbf, q[i], digests, x["nblocks"][i], x["room"][i], x["take"][i], hb.anchors[index - dense, i],
                hb.k, scale, r.blocks.block_size, entropy=hb.entropy[i] if index == r.hbf.entropy_at else None,
            )  # fmt: skip
            hb.picked[index - dense, i].copy_(blocks)
            listed = torch.zeros((self.hkv, nw), dtype=table.dtype, device=table.device)
            listed[:, :n] = table[i][blocks.clamp(0, w - 1)]
            selects = x["room"][i] > 0
            hb.heads[i] = torch.where(selects, listed, whole[i])
            hb.nblocks[i] = torch.where(selects, x["room"][i] + sinks + recent, self.nblocks[i])
        return hb.heads, hb.nblocks, self.tail

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        paged_write(k, v, (self.pools.k[0], self.pools.k[1]), (self.pools.v[0], self.pools.v[1]), self.rows[index])
        if self.g.hbf is None or not self.runner.digests.keeps(index):  # (a window or dense layer keeps none)
            return
        digests = self.runner.digests  # each selecting slot's new key into its digest (selection reads it)
        if select.available(k.device):
            select.fold(digests.arena(index), self.inputs["dig_row"], k)
        else:
            digests.fold(index, self.inputs["dig_row"], k)


class DecodeGraphs:
    """The runner's CUDA graphs of decode steps (see the module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.capture = runner.device.type == "cuda"
        # On by default on CUDA; tests turn it on on the CPU (with `kernel_attention`).
        self.enabled = self.capture
        self._graphs: OrderedDict[GraphKey, _Graph] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0  # steps run through a graph's buffers (counted on the CPU too)
        self.built = 0  # graphs made (static buffers; on CUDA each is then captured)
        self.captures = 0  # captures (CUDA): one per graph made, and again after the digest arena moved
        # HBF picks promoted during the next step (`resolve`); tests turn it off to compare a
        # step's promotions with the eager path's.
        self.lag = True
        self._lagged: _Pending | None = None  # the last replayed step's picks, until a report takes them
        sinks, recent = base_sizes(runner.hbf, runner.blocks.block_size)
        # every selecting graph's top-k capacity: the widest window's room (module docstring)
        self.capacity = room_bucket(max(1, runner.hbf.window_max_tokens // runner.blocks.block_size - sinks - recent))
        self.warm_keys: frozenset[GraphKey] = frozenset()  # captured before ready, never dropped
        # The layers a selecting slot reads whole (the dense ones, the sliding-window ones), and the
        # sliding-window layers among the sparse ones, as rows of the picks (never promoted).
        dense, windows = runner.hbf.dense_layers, runner.windows
        self._whole_layers = np.array([i < dense or w is not None for i, w in enumerate(windows)])
        rows = [i - dense for i, w in enumerate(windows) if w is not None and i >= dense]
        self.window_rows = torch.tensor(rows, dtype=torch.int64, device=runner.device) if rows else None
        # After the warm-up: a step whose graph is not captured runs eagerly, its key waits here
        # (eager steps so far) to be captured between steps (`capture_deferred`).
        self.deferring = False
        self.deferred: OrderedDict[GraphKey, int] = OrderedDict()
        self.eager_steps = 0  # steps run uncaptured while their graph waited to be captured
        self.captures_after_ready = 0
        self.captures_ahead = 0  # of those, before the step that joined sessions to a batch (`ahead`)
        self.table_writes = {"moved": 0, "whole": 0}  # slots' locations written: the blocks moved, or all
        self.ahead_keys: set[GraphKey] = set()  # the graphs `ahead` captured
        self.capture_s: dict[GraphKey, float] = {}  # how long each graph's last capture took

    @property
    def nbytes(self) -> int:
        """The static buffers of the graphs kept (their intermediates are in the shared pool)."""
        return sum(g.nbytes for g in self._graphs.values())

    def _room(self, seq: SeqId, num_blocks: int) -> int:
        """A session's room past sinks + recent this step (<= 0: it would not select)."""
        r = self.runner
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        budget = max(1, r.kv.selection(seq).window_tokens // r.blocks.block_size)
        if num_blocks <= budget:
            return 0
        return min(budget - sinks - recent, num_blocks - sinks - recent)

    def _key(self, seqs: list[SeqId], blocks: list[int]) -> GraphKey:
        """The graph a step of these sessions replays, their tables `blocks` blocks wide (their
        shapes only). Gives every selecting session's digests room for the new key's part (their
        extents may move: read after)."""
        r = self.runner
        batch, width = batch_bucket(len(seqs)), width_bucket(max(blocks))
        selecting = [i for i, s in enumerate(seqs) if r.kv.policy(s).selects]
        if not selecting:
            return GraphKey(batch, width)
        for i in selecting:
            r.digests.ensure(seqs[i], blocks[i] * r.digests.parts)
        k = max(self.capacity, room_bucket(max(self._room(seqs[i], blocks[i]) for i in selecting)))
        return GraphKey(batch, width, k, mixed=len(selecting) < len(seqs))

    @torch.inference_mode()
    def ahead(self, seqs: list[SeqId], blocks: list[int]) -> GraphKey | None:
        """Before the step that gives some of `seqs` their first token: the graph of the decode
        step after it, where `seqs` (the batch then, more than one) have tables `blocks` blocks
        wide, captured now unless it would replay already; the key captured, or None. The capture
        stalls the step that computes the newcomers' prompts (which delays the decoding streams
        anyway) instead of a later decode step of every stream, after `DEFER_STEPS` uncaptured
        ones. As `applies` (a selecting session needs its digests: a newcomer whose prompt was
        appended before, not one whose prompt this step computes), but nothing is counted."""
        r = self.runner
        if not (self.enabled and self.deferring) or not 1 < len(seqs) <= MAX_BATCH:
            return None
        if r.model.model.layers[0].self_attn.attention is not kernel_attention:  # type: ignore[union-attr]
            return None
        for seq, n in zip(seqs, blocks, strict=True):
            policy = r.kv.policy(seq)
            if not policy.graphable:
                return None
            if policy.selects and (
                r.hbf.dense_layers >= r.blocks.num_layers or not r.digests.has(seq) or self._room(seq, n) <= 0
            ):
                return None
        key = self._key(seqs, blocks)
        if self._current(key) or not self.prepare(key):
            return None
        self.deferred.pop(key, None)
        self.captures_after_ready += 1
        self.captures_ahead += 1
        self.ahead_keys.add(key)
        return key

    def applies(self, seqs: list[SeqId]) -> GraphKey | None:
        """The graph a decode step of these sessions runs (replayed; uncaptured while it waits in
        `deferred`), or None where it runs eagerly. The planner asks only for decode steps with
        nothing to stage from the archive."""
        r = self.runner
        if not self.enabled or len(seqs) > MAX_BATCH:
            return None
        if r.model.model.layers[0].self_attn.attention is not kernel_attention:  # type: ignore[union-attr]
            return None
        tables = [r.blocks.table(s) for s in seqs]
        for seq, t in zip(seqs, tables, strict=True):
            policy = r.kv.policy(seq)
            if not policy.graphable:
                return None
            if policy.selects:
                if r.hbf.dense_layers >= r.blocks.num_layers or not r.digests.has(seq):
                    return None
                if self._room(seq, t.num_blocks) <= 0:
                    return None  # a context within its window reads every block: eager
        key = self._key(seqs, [t.num_blocks for t in tables])
        if self.deferring and not self._current(key):
            self.deferred[key] = self.deferred.get(key, 0) + 1
            self.eager_steps += 1  # its forward runs uncaptured (`run`), captured between steps (`capture_deferred`)
        return key

    def _current(self, key: GraphKey) -> bool:
        """Whether `key`'s graph can replay now: made, and on CUDA captured against the digest
        arena of now (on the CPU the forward reads the arena as it is: nothing goes stale)."""
        g = self._graphs.get(key)
        if g is None or not self.capture:
            return g is not None
        return g.graph is not None and (g.hbf is None or g.generation == self.runner.digests.generation)

    def warm_set(self, max_tokens: int) -> list[GraphKey]:
        """The graphs captured before ready: one session (batch 1) at every width bucket up to
        `max_tokens`, exact at every width and selecting at every width past the narrowest window
        (`window_min_tokens`), with `capacity`. [] where graphs are off or the model's attention
        is not the paged kernel's."""
        r = self.runner
        if not self.enabled or r.model.model.layers[0].self_attn.attention is not kernel_attention:  # type: ignore[union-attr]
            return []
        bs = r.blocks.block_size
        widths = sorted({width_bucket(n) for n in range(1, -(-max_tokens // bs) + 1)})
        keys = [GraphKey(1, w) for w in widths]
        sinks, recent = base_sizes(r.hbf, bs)
        least = max(1, r.hbf.window_min_tokens // bs)  # a session selects past its window's blocks
        if r.hbf.dense_layers < r.blocks.num_layers:
            keys += [GraphKey(1, w, self.capacity) for w in widths if w > max(least, sinks + recent)]
        return keys

    def warm(self, keys: list[GraphKey], now: bool = True) -> int:
        """Keep `keys` (never dropped) and capture them now (on the CPU: make them and run each
        once), or, with `now` False, leave them waiting in `deferred` to be captured between
        steps (`capture_deferred`: while the engine idles, or once steps have wanted one); then
        defer every other graph (`deferring`). Returns the graphs captured."""
        self.warm_keys = self.warm_keys | frozenset(keys)  # first: none of them is dropped as the others come
        made = 0
        if now:
            made = sum(self.prepare(key) for key in keys)
        else:
            self.deferred.update((key, self.deferred.get(key, 0)) for key in keys)
        self.deferring = True
        return made

    @property
    def warm_waiting(self) -> int:
        """Graphs of the warm set not captured yet (`warm(now=False)`)."""
        return sum(1 for key in self.deferred if key in self.warm_keys)

    def capture_deferred(self, idle: bool) -> list[GraphKey]:
        """Between steps: capture a graph waiting in `deferred`: when the engine idles, the one
        steps wanted most (else the first waiting: the warm set in its order), one a call so that
        a request that comes meanwhile waits for one capture at most; while it is busy, one that
        has run `DEFER_STEPS` steps uncaptured. Returns those captured."""
        if not self.deferred:
            return []
        waiting = self.deferred
        key = (
            max(waiting, key=lambda k: waiting[k])  # (the first among equals)
            if idle
            else next((k for k, steps in waiting.items() if steps >= DEFER_STEPS), None)
        )
        if key is None:
            return []
        del self.deferred[key]
        if not self.prepare(key):
            return []
        self.captures_after_ready += 1
        return [key]

    @torch.inference_mode()
    def prepare(self, key: GraphKey) -> bool:
        """Make `key`'s graph and capture it from padding inputs (every slot feeds token 0 into
        the null slot; the static buffers' values are the host's to write before each replay).
        On the CPU the forward runs once instead. Returns whether it was captured or made now."""
        if self._current(key):
            return False
        g = self._graph(key)
        if g.copied is not None:
            g.copied.synchronize()
        _pad(g.small.host, 0)
        g.tables.host["locs"][...] = 0
        g.slots = [(SeqId(-1), 0, 0, False)] * key.batch  # what `_fill_tables` writes for padding
        g.below = [0] * key.batch
        g.whole = [0] * key.batch
        g.selecting = ()
        g.generation = self.runner.digests.generation
        g.small.upload(non_blocking=False)
        g.tables.upload(non_blocking=False)
        t0 = time.perf_counter()
        if self.capture:
            self._capture(g)
            # Replayed once from the same padding inputs (it writes what the capture's warm-up
            # runs wrote): a graph's first launch also uploads it to the device, which is then
            # not paid by the first request's step that needs it.
            assert g.graph is not None
            g.graph.replay()
        else:
            g.hidden = self._forward(g)
        self.capture_s[key] = time.perf_counter() - t0
        return True

    def _graph(self, key: GraphKey) -> _Graph:
        """`key`'s graph, made if new; the least recently used beyond the warm set and
        `MAX_GRAPHS` are dropped."""
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._allocate(key)
            extra = [k for k in self._graphs if k not in self.warm_keys and k != key]
            for old in extra[: max(0, len(extra) + 1 - MAX_GRAPHS)]:
                del self._graphs[old]
        self._graphs.move_to_end(key)
        return g

    @torch.inference_mode()
    def run(self, plan: StepPlan, ids: list[int], report: StepReport) -> torch.Tensor:
        """The planned step's forward through its graph (`plan.graph`): hidden states
        [len(seqs), hidden]. The step's blocks are already appended (`plan.rows`: [L, B] the new
        tokens' rows); the whole tables it read go into the report's reads, and its graph into
        `report.replay` (its picks are read after the step: `resolve`)."""
        r = self.runner
        seqs, rows, key = plan.seqs, plan.rows, plan.graph
        assert key is not None, "a graph step's plan names its graph"
        tables = [r.blocks.table(s) for s in seqs]
        b = len(seqs)
        g = self._graph(key)
        if g.hbf is not None and g.generation != r.digests.generation:
            g.graph = None  # captured against a digest arena since replaced: captured again
            g.generation = r.digests.generation
        if g.copied is not None:
            g.copied.synchronize()  # the staging buffers are free again (normally long since)
        x = g.small.host
        _pad(x, b)
        x["rows"][:, :b] = rows
        bs = r.blocks.block_size
        for i, t in enumerate(tables):
            x["nblocks"][i], x["tail"][i] = t.num_blocks, t.num_tokens - (t.num_blocks - 1) * bs
            x["token"][i], x["pos"][i], x["ends"][i] = ids[i], t.num_tokens - 1, t.num_tokens
        if g.hbf is not None:
            self._hbf_inputs(g, seqs, tables)
        changed = self._fill_tables(g, seqs, tables)
        g.small.upload(non_blocking=self.capture)
        if changed:
            g.tables.upload(non_blocking=self.capture)
        if self.capture:
            g.copied = torch.cuda.Event()
            g.copied.record()
        waits = key in self.deferred  # captured between steps, never on a step's path: uncaptured now
        if g.graph is None and self.capture and not waits:
            self._capture(g)
        if g.graph is not None and not waits:
            g.graph.replay()
        else:
            g.hidden = self._forward(g)
        if not waits:
            self.replays += 1
        report.reads += self._reads(g, tables)
        report.replay = g
        assert g.hidden is not None
        return g.hidden[:b]

    def resolve(self, report: StepReport) -> None:
        """After a replayed step (and the launch of its logits): its selecting slots' picks go to
        the host as (layer, block) keys for promotion, their entropies to their sessions' states
        (left on the device). With `lag` the picks are copied out asynchronously and promoted by
        the next step's commit (`take_pending`: the host's planning then overlaps the device's
        work); without, the host waits for them here and the report's picks get them."""
        g = report.replay
        if g is None or g.hbf is None or not g.selecting:
            return
        hb = g.hbf
        slots = tuple(i for i, _, _ in g.selecting)
        seqs = tuple(seq for _, seq, _ in g.selecting)
        hb.codes_host.copy_(hb.codes, non_blocking=self.capture)
        hb.entropy_host.copy_(hb.entropy, non_blocking=self.capture)
        done = torch.cuda.Event() if self.capture else None
        if done is not None:
            done.record()
        if self.lag:  # counted later, against where this step read (coded in the step)
            self._lagged = _Pending(seqs, slots, hb.codes_host, hb.entropy_host, done, True)
        else:  # promote counts them against the tables, unchanged since the step
            pending = _Pending(seqs, slots, hb.codes_host, hb.entropy_host, done, False)
            report.picks.update(self._keys(pending))

    def take_pending(self) -> _Pending | None:
        """The previous replayed step's picks on their way to the host, if any (a step's report
        takes them: its commit applies them, `picks`)."""
        pending, self._lagged = self._lagged, None
        return pending

    def picks(self, pending: _Pending) -> dict[SeqId, np.ndarray]:
        """A lagged step's picks as (layer, block) keys per session, their reads counted as that
        step made them (against the locations it read), for promotion now."""
        return self._keys(pending)

    def take_lagged(self) -> dict[SeqId, np.ndarray]:
        """The previous replayed step's picks (`picks`), {} if none wait: for what changes the
        sessions' tables between steps (`KVCache.flush_lagged`)."""
        pending = self.take_pending()
        return {} if pending is None else self.picks(pending)

    def _keys(self, p: _Pending) -> dict[SeqId, np.ndarray]:
        """Each session's picks as (layer, block) keys (`layer * table.capacity + block`), from the
        step's codes (`_code_picks`). A lagged step's: distinct and ascending, their reads counted
        here as that step made them (`Promoter.count_distinct`); else one key per KV head's read,
        for `promote` to count against the tables, unchanged since."""
        r = self.runner
        if p.done is not None:
            p.done.synchronize()  # normally long since
        codes = p.codes.numpy()  # [Ls, B, W]
        entropy = p.entropy.numpy()  # [B]
        dense, w = r.hbf.dense_layers, codes.shape[2]
        out: dict[SeqId, np.ndarray] = {}
        for seq, slot in zip(p.seqs, p.slots, strict=True):
            if not r.blocks.has(seq):
                continue  # released since
            # Its entropy, read from the host copy (a read of the device's value would wait for
            # whatever step is running); a lagged step's came after its `after_step`.
            record_entropy(r.kv.selection(seq), float(entropy[slot]), current=not p.lagged)
            c = np.ascontiguousarray(codes[:, slot, :]).ravel()  # [Ls * W]
            at = np.flatnonzero(c)
            code = c.take(at)
            layer, block = np.divmod(at, w)
            keys = (layer + dense) * r.blocks.table(seq).capacity + block
            heads = (code & 0x7F).astype(np.int64)
            if p.lagged:
                r.kv.promoter.count_distinct(seq, keys, code >= 0x80, heads)
                out[seq] = keys
            else:
                out[seq] = np.repeat(keys, heads)
        return out

    def _hbf_inputs(self, g: _Graph, seqs: list[SeqId], tables: list[BlockTable]) -> None:
        """Each selecting slot's room, anchors taken and digest rows (the small buffer), and its
        anchors copied into the graph's buffer when the slot's session or its anchors changed."""
        r, hb, x = self.runner, g.hbf, g.small.host
        assert hb is not None
        dense, a = r.hbf.dense_layers, hb.anchors.shape[-1]
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        pt = r.digests.part_tokens
        selecting = []
        for i, (seq, t) in enumerate(zip(seqs, tables, strict=True)):
            state = r.kv.selection(seq)
            if not state.policy.selects:
                continue
            budget = max(1, state.window_tokens // r.blocks.block_size)
            room = self._room(seq, t.num_blocks)
            selecting.append((i, seq, room))
            first = state.head_anchors.get(r.hbf.entropy_at)  # (the first selecting layer: its anchors are there)
            width = min(a, first.shape[1]) if first is not None else 0
            base, pos = r.digests.base(seq), t.num_tokens - 1
            x["room"][i], x["take"][i] = room, min(int((budget - sinks - recent) * r.hbf.anchor_share), width)
            x["parts_live"][i], x["dig_base"][i], x["dig_row"][i] = pos // pt + 1, base, base + pos // pt
            x["dig_src"][i], x["dig_shared"][i] = r.digests.source(seq)  # (a fork's first parts: its parent's rows)
            if hb.anchored[i] == (seq, state.anchors_version):
                continue
            hb.anchored[i] = (seq, state.anchors_version)
            hb.anchors[:, i].zero_()
            for layer in range(dense, r.blocks.num_layers):
                anchors = state.head_anchors.get(layer)
                if anchors is not None:
                    m = min(a, anchors.shape[1])
                    hb.anchors[layer - dense, i, :, :m].copy_(anchors[:, :m])
        g.selecting = tuple(selecting)

    def _allocate(self, key: GraphKey) -> _Graph:
        r = self.runner
        nl, b, w, dev, pin = r.blocks.num_layers, key.batch, key.width, r.device, self.capture
        small = StaticInputs({"rows": (nl, b), **{name: (b,) for name in SLOT_INPUTS}}, torch.int64, dev, pin)
        g = _Graph(key, small, StaticInputs({"locs": (nl, b, w)}, torch.int32, dev, pin))
        if key.k:
            hkv = r.hbm.k.shape[0]
            sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
            ls = nl - r.hbf.dense_layers
            most = max(1, r.hbf.window_max_tokens // r.blocks.block_size - sinks - recent)  # probe_anchors' width
            n = sinks + key.k + recent
            g.hbf = _Hbf(
                k=key.k,
                anchors=torch.zeros((ls, b, hkv, most), dtype=torch.int64, device=dev),
                picked=torch.zeros((ls, b, hkv, n), dtype=torch.int64, device=dev),
                codes=torch.zeros((ls, b, w), dtype=torch.uint8, device=dev),
                entropy=torch.zeros(b, dtype=torch.float32, device=dev),
                heads=torch.zeros((b, hkv, max(n, w) if key.mixed else n), dtype=torch.int32, device=dev),
                nblocks=torch.ones((b, hkv), dtype=torch.int32, device=dev),
                anchored=[None] * b,
                codes_host=torch.zeros((ls, b, w), dtype=torch.uint8, pin_memory=pin),
                entropy_host=torch.zeros(b, dtype=torch.float32, pin_memory=pin),
            )
        self.built += 1
        return g

    def _fill_tables(self, g: _Graph, seqs: list[SeqId], tables: list[BlockTable]) -> bool:
        """Write the locations of the slots whose table changed since this graph last saw them (or
        whose session did); returns whether any did."""
        locs = g.tables.host["locs"]
        changed = False
        selects = {i for i, _, _ in g.selecting}
        want = [(s, t.version, t.num_blocks, i in selects) for i, (s, t) in enumerate(zip(seqs, tables, strict=True))]
        want += [(SeqId(-1), 0, 0, False)] * (g.key.batch - len(seqs))
        if len(g.slots) != g.key.batch:
            g.slots = [(SeqId(-2), 0, 0, False)] * g.key.batch
            g.below = [0] * g.key.batch
            g.whole = [0] * g.key.batch
        for i, entry in enumerate(want):
            if g.slots[i] == entry:
                continue
            changed = True
            seen, g.slots[i] = g.slots[i], entry
            if i >= len(tables):
                locs[:, i, :] = 0
                g.below[i] = g.whole[i] = 0
                continue
            t, nb = tables[i], entry[2]
            moves = self._moves(seen, entry, t)
            if moves is not None:  # the blocks it saw are where they were, bar those moved or added
                layers, blocks = moves
                if len(blocks):  # (not a long context's whole table: a step's promotions)
                    cell = np.unique(layers * t.capacity + blocks)
                    layers, blocks = cell // t.capacity, cell % t.capacity
                    old, new = locs[layers, i, blocks], t.locations_at(layers, blocks)
                    locs[layers, i, blocks] = new
                    read = self._whole_layers[layers] if entry[3] else True  # the blocks it reads whole
                    g.below[i] += int(np.count_nonzero(read & (new < 0))) - int(np.count_nonzero(read & (old < 0)))
                g.whole[i] = int(np.count_nonzero(self._whole_layers)) * nb if entry[3] else len(locs) * nb
                if self.runner.check_invariants:  # the tests: as the whole table gives them
                    rows = self._whole_layers if entry[3] else slice(None)
                    where = t.all_locations()
                    assert (locs[:, i, :nb] == where).all() and not locs[:, i, nb:].any(), "moved locations"
                    assert g.below[i] == int(np.count_nonzero(where[rows] < 0)), "moved blocks read below HBM"
                self.table_writes["moved"] += 1
                continue
            self.table_writes["whole"] += 1
            where = t.all_locations()
            locs[:, i, :nb] = where
            locs[:, i, nb:] = 0
            # the blocks it reads whole: every layer's, or (selecting) the dense and window layers'
            # (a window layer's: its window's)
            whole = self.runner.blocks.decode_reads(entry[0]) & (self._whole_layers[:, None] if entry[3] else True)
            g.whole[i] = int(np.count_nonzero(whole))
            g.below[i] = int(np.count_nonzero(whole & (where < 0)))
        return changed

    def _moves(self, seen: tuple, entry: tuple, t: BlockTable) -> tuple[np.ndarray, np.ndarray] | None:
        """The blocks whose locations need writing where a slot's table went from what the graph
        saw (`seen`: session, version, blocks, selects) to `entry` by moves and appends alone
        (`BlockTable.moves_since`: a step's promotions, evictions, new blocks), in a model without
        window layers (whose blocks read whole change with every token); None: all of them."""
        if seen[0] != entry[0] or seen[3] != entry[3] or seen[2] > entry[2] or len(self.runner.blocks.window_layers):
            return None
        moves = t.moves_since(seen[1])
        if moves is not None and len(moves[1]) > t.ids.shape[0] * entry[2] // 4:
            return None  # (a large part of the table: written whole, without the sort)
        return moves

    def _forward(self, g: _Graph) -> torch.Tensor:
        r = self.runner
        x = g.small.device
        hidden = r.model(x["token"], x["pos"], _GraphKV(r.pools, r, g))
        if g.hbf is not None:
            self._code_picks(g)
        return hidden

    def _code_picks(self, g: _Graph) -> None:
        """The step's picks as the host needs them for promotion, made on the device: for every
        sparse layer, slot and block, how many KV heads read it (each selecting slot's first
        `sinks + room + recent` list entries) and, in the high bit, whether the step read it from
        below HBM (its location in `locs`). The host reads W bytes per layer and slot instead of
        every head's list, already a union, its locations already looked up."""
        r, hb, x = self.runner, g.hbf, g.small.device
        assert hb is not None
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        ls, b, hkv, n = hb.picked.shape
        w = g.key.width
        room = x["room"]
        valid = (torch.arange(n, device=room.device) < (room + sinks + recent)[:, None]) & (room > 0)[:, None]
        ones = valid[None, :, None, :].expand(ls, b, hkv, n).reshape(ls, b, hkv * n).to(torch.int32)
        heads = torch.zeros((ls, b, w), dtype=torch.int32, device=room.device)
        heads.scatter_add_(2, hb.picked.clamp(0, w - 1).view(ls, b, hkv * n), ones)
        if self.window_rows is not None:  # a sliding-window layer never selects: nothing of it to promote
            heads.index_fill_(0, self.window_rows, 0)  # (no host tensor: a captured step's)
        below = (g.tables.device["locs"][r.hbf.dense_layers :] < 0) & (heads > 0)  # [Ls, B, W], read blocks only
        hb.codes.copy_(heads.clamp(max=127).to(torch.uint8) | (below.to(torch.uint8) << 7))

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture. The
        warm-up runs write this step's K/V and digests, the same values the replay writes again.
        A second warm-up runs only where the first compiled a kernel variant: each is a forward's
        host time (about a third of a capture's), and a capture stalls the steps of every stream
        that waits for it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            compiled = loader.COMPILES.count
            self._forward(g)
            if loader.COMPILES.count != compiled:
                self._forward(g)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.hidden = self._forward(g)
        g.graph = graph
        self.captures += 1

    def _reads(self, g: _Graph, tables: list[BlockTable]) -> list[Reads]:
        """Every block of every layer a slot that does not select reads, and of a selecting slot's
        dense layers, was read; those in DDR over PCIe (counted when the tables were written). A
        selecting slot's picks are counted with their promotion (`resolve`)."""
        return [Reads(g.slots[i][0], g.whole[i], g.below[i]) for i in range(len(tables))]
