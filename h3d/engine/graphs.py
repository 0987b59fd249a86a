"""Decode steps replayed as CUDA graphs: the whole forward of a decode step is one launch.

A decode step of a Llama-8B shape issues a few hundred kernels (32 layers of norms, projections,
RoPE, the cache write, the paged attention kernel and its merge, the MLP); launched one by one from
Python they cost more host time than the GPU needs for them. `DecodeGraphs` captures the forward
once per *bucket* (batch padded to a power of two, block-table width rounded up to a quarter of a
power of two) and replays it; between steps only its static inputs change:

- `locs` [L, B, W] int32: every layer's block locations (HBM slot, or -(DDR slot + 1): the kernel
  reads pinned DDR in place), copied to the device only when some session's table changed (a new
  block, a move between tiers);
- `small` int64: the new tokens' cache rows [L, B] (HBM, or pinned DDR written in place by
  `paged_write`), list lengths [B], last-block fill [B], token ids, positions and sequence ends
  [B], and for HBF entries the room past sinks + recent and the anchors taken [B], copied every
  step (a few hundred bytes).

Sessions under `attention_entropy` select inside the graph, through the kernels of
`h3d.kernels.select` (their torch twin, `h3d.hbf.policy.select_static`, where Triton cannot run):
for each sparse layer the digest bound over the session's digests, its prompt anchors first,
each head's best blocks up to a fixed capacity k (the batch's largest room, rounded up to a
power of two; each entry takes its own room of it), and the attention kernel's per-head lists
gathered from `locs`; the new key is folded into its digest and the first sparse layer's entropy
written to a buffer. The blocks each head read come back to the host after the step (`resolve`:
an asynchronous copy), and are promoted during the next step (`take_lagged`), so that the host's
planning overlaps the device's work; their reads are counted against the locations the step
read. Such a graph reads the sessions' own digest
tensors, so it belongs to one batch of sessions (its key names them and where their digests
are); it is captured the second time that batch comes (a batch seen once runs eagerly), and
replayed while it lasts.

Padding entries of the batch feed token 0 at position 0, write into the null slot (row 0, never
read: lists mask it) and attend to that one token; their outputs are dropped.

When it applies (`applies`): every chunk is one decode token, every session is under `exact`, or
under `attention_entropy` with a context longer than its window (and room past sinks + recent),
and every block is in HBM or DDR (none to stage from the archive). Anything else runs eagerly
(`h3d.engine.runner._Step`).

No host synchronization inside a step: the inputs' copies are asynchronous (pinned staging), and
the staging buffers are rewritten only after the previous step's copy has completed (an event).

On the CPU (tests) the same static-buffer forward runs eagerly, without capture: buckets, padding,
table caching and the cache writes are the GPU path's, only the replay differs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from h3d.hbf.policy import base_sizes, select_static
from h3d.kernels import select
from h3d.kernels.copies import paged_write
from h3d.kv.attention import LayerKV, Pools, kernel_attention
from h3d.kv.blocks import BlockTable, SeqId

if TYPE_CHECKING:
    from h3d.engine.runner import ModelRunner, _Step

MAX_BATCH = 256
MAX_GRAPHS = 32  # least recently used graphs beyond this are dropped (their memory returns to the pool)
SMALL = 7  # per-entry int64 inputs after the rows: nblocks, tail, token, position, end, room, take


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


@dataclass(slots=True)
class _Hbf:
    """A graph's `attention_entropy` entries: who they are, their static inputs and outputs."""

    entries: tuple[int, ...]  # batch indices under attention_entropy
    seqs: tuple[SeqId, ...]  # their sessions (the graph reads their digests)
    k: int  # top-k capacity
    anchors: torch.Tensor  # [Ls, E, Hkv, A] int64: each sparse layer's prompt anchors (0 pads: a sink)
    picked: torch.Tensor  # [Ls, E, Hkv, n] int64: the blocks each head read (the step's output)
    entropy: torch.Tensor  # [E] fp32: the first sparse layer's block-score entropy (output)
    mixed: bool  # some real entry is under exact (its lists are whole tables)
    index: torch.Tensor  # [E] int64: `entries` on the device
    heads: torch.Tensor  # [B, Hkv, NW] int32: the kernels' lists (rows past the batch stay 0)
    nblocks: torch.Tensor  # [B, Hkv] int32: their lengths (padding rows: 1)
    versions: list[int] = field(default_factory=list)  # per entry: the anchors_version copied in
    rooms: list[int] = field(default_factory=list)  # per entry: this step's room (host copy)
    picked_host: torch.Tensor | None = None  # where `picked` is copied after a step


@dataclass(frozen=True, slots=True)
class _Pending:
    """A replayed step's HBF picks on their way to the host (see `DecodeGraphs.resolve`)."""

    seqs: tuple[SeqId, ...]
    rooms: tuple[int, ...]
    picked: torch.Tensor  # [Ls, E, Hkv, n] host copy (pinned on CUDA)
    done: torch.cuda.Event | None  # the copy's completion (CUDA)
    seen: np.ndarray | None  # [L, E, W] the locations the step read (HBM slot >= 0, DDR < 0), if lagged


@dataclass(slots=True)
class _Graph:
    """One bucket's static buffers, and its captured graph (None on the CPU)."""

    batch: int
    width: int
    locs_host: torch.Tensor  # [L, B, W] int32 (pinned on CUDA)
    small_host: torch.Tensor  # [L * B + SMALL * B] int64 (pinned on CUDA)
    locs: torch.Tensor  # device copies of the two
    small: torch.Tensor
    hbf: _Hbf | None = None
    hidden: torch.Tensor | None = None  # the forward's output [B, hidden] (static under a graph)
    graph: torch.cuda.CUDAGraph | None = None
    tables: list[tuple[SeqId, int, int]] = field(default_factory=list)  # per entry: (seq, version, blocks) in locs
    below: list[int] = field(default_factory=list)  # per entry: its blocks in DDR (the layers it reads whole)
    copied: torch.cuda.Event | None = None  # the last input copy (the staging is reused after it)


class _GraphKV:
    """The static-buffer view of the KV cache for one decode step (a `StepKV`)."""

    def __init__(self, pools: Pools, runner: ModelRunner, g: _Graph) -> None:
        nl, b = runner.blocks.num_layers, g.batch
        hkv = runner.hbm.k.shape[0]
        self.pools = pools
        self.runner = runner
        self.g = g
        self.rows = g.small[: nl * b].view(nl, b)
        nblocks, tail, _, pos, ends, room, take = g.small[nl * b :].view(SMALL, b)
        self.seq_ends = ends
        self.num_blocks, self.pos, self.room, self.take = nblocks, pos, room, take
        if g.hbf is not None:  # parts that hold a key: up to the new token's
            self.parts_live = pos // runner.digests.part_tokens + 1
        self.nblocks = nblocks.to(torch.int32)[:, None].expand(-1, hkv)
        self.tail = tail.to(torch.int32)
        self.locs = g.locs
        self.hkv = hkv
        self.query_lens = (1,) * b
        self.mixed = g.hbf is not None and g.hbf.mixed

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        table = self.locs[index]  # [B, W]
        hb, r = self.g.hbf, self.runner
        dense = r.hbf.dense_layers
        if hb is None or index < dense:
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
        )

    def _select_kernels(self, index: int, q: torch.Tensor, scale: float, table: torch.Tensor) -> tuple:
        """The HBF entries' lists from the selection kernels (`h3d.kernels.select`): per entry the
        masked bounds, then one top-k and one list kernel for all of them; the first sparse
        layer's entropy from the raw bounds."""
        r, hb = self.runner, self.g.hbf
        assert hb is not None
        dense = r.hbf.dense_layers
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        w = table.shape[1]
        heads, nblocks = hb.heads, hb.nblocks
        if hb.mixed:  # exact entries read every block
            heads[:, :, :w] = table[:, None, :]
            nblocks.copy_(self.nblocks)
        masked = torch.empty((len(hb.seqs), self.hkv, w), dtype=torch.float32, device=q.device)
        for e, (i, seq) in enumerate(zip(hb.entries, hb.seqs, strict=True)):
            digests = r.digests.get(seq, index, w)  # [Hkv, W, parts, 2, D]
            raw = torch.empty((self.hkv, w), dtype=torch.float32, device=q.device) if index == dense else None
            live, take, anchors = self.parts_live[i], self.take[i], hb.anchors[index - dense, e]
            select.scores(masked[e], q[i], digests, self.num_blocks[i], live, take, anchors, sinks, recent, raw)
            if raw is not None:
                p = torch.softmax(raw.amax(dim=0) * scale, dim=-1)
                hb.entropy[e].copy_(-(p * torch.log(p.clamp_min(1e-30))).sum())
        top = select.top_room(masked, hb.index, self.room, hb.k)  # [E, Hkv, k]: the batch's in one launch
        picked = hb.picked[index - dense]
        select.lists(top, table, hb.index, self.num_blocks, self.room, heads, nblocks, picked, sinks, recent)
        return heads, nblocks, self.tail

    def _select_torch(self, index: int, q: torch.Tensor, scale: float, table: torch.Tensor) -> tuple:
        """The kernels' twin (a CPU without Triton's interpreter): `select_static`, then the
        lists gathered from the table."""
        r, hb = self.runner, self.g.hbf
        assert hb is not None
        dense = r.hbf.dense_layers
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        n = sinks + hb.k + recent
        b, w = table.shape
        heads = torch.zeros((b, self.hkv, max(n, w) if self.mixed else n), dtype=table.dtype, device=table.device)
        if self.mixed:  # exact entries read every block
            heads[:, :, :w] = table[:, None, :]
        nblocks = self.nblocks.clone()
        for e, (i, seq) in enumerate(zip(hb.entries, hb.seqs, strict=True)):
            digests = r.digests.get(seq, index, w)  # [Hkv, W, parts, 2, D]
            blocks = select_static(
                r.hbf, q[i], digests, self.num_blocks[i], self.room[i], self.take[i], hb.anchors[index - dense, e],
                hb.k, scale, r.blocks.block_size, entropy=hb.entropy[e] if index == dense else None,
            )  # fmt: skip
            hb.picked[index - dense, e].copy_(blocks)
            heads[i] = 0
            heads[i, :, :n] = table[i][blocks]
            nblocks[i] = (self.room[i] + sinks + recent).to(torch.int32)
        return heads, nblocks, self.tail

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        paged_write(k, v, (self.pools.k[0], self.pools.k[1]), (self.pools.v[0], self.pools.v[1]), self.rows[index])
        hb = self.g.hbf
        if hb is None:
            return
        digests = self.runner.digests
        fused = select.available(k.device)
        for i, seq in zip(hb.entries, hb.seqs, strict=True):  # the new key into its digest (selection reads it)
            if fused:
                select.fold(digests.layer(seq, index), self.pos[i : i + 1], k[i : i + 1], digests.part_tokens)
            else:
                digests.fold(seq, index, self.pos[i : i + 1], k[i : i + 1])


class DecodeGraphs:
    """The runner's CUDA graphs of decode steps (see the module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.capture = runner.device.type == "cuda"
        # On by default on CUDA; tests turn it on on the CPU (with `kernel_attention`).
        self.enabled = self.capture
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # recent HBF batches' keys (a graph is made at the second)
        self._applied: tuple | None = None  # the key `applies` found for the step `run` replays next
        self.replays = 0  # steps run through a bucket (counted on the CPU too)
        self.captures = 0
        # HBF picks promoted during the next step (`resolve`); tests turn it off to compare a
        # step's promotions with the eager path's.
        self.lag = True
        self._lagged: _Pending | None = None

    def _room(self, seq: SeqId, num_blocks: int) -> int:
        """A session's room past sinks + recent this step (<= 0: it would not select)."""
        r = self.runner
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        budget = max(1, r.kv.selection(seq).window_tokens // r.blocks.block_size)
        if num_blocks <= budget:
            return 0
        return min(budget - sinks - recent, num_blocks - sinks - recent)

    def _key(self, seqs: list[SeqId], tables: list[BlockTable]) -> tuple:
        """The graph a step of these sessions replays: (batch bucket, table width) for exact ones;
        with HBF entries also their top-k capacity, their batch indices, and their sessions and
        digests (the graph reads those tensors). Makes the digests room for the width."""
        r = self.runner
        width = width_bucket(max(t.num_blocks for t in tables))
        entries = [i for i, s in enumerate(seqs) if r.kv.policy(s).selects]
        if not entries:
            return (batch_bucket(len(seqs)), width)
        k = room_bucket(max(self._room(seqs[i], tables[i].num_blocks) for i in entries))
        for i in entries:
            r.digests.ensure(seqs[i], width * r.digests.parts)
        who = tuple((i, seqs[i], r.digests.data_ptr(seqs[i])) for i in entries)
        return (batch_bucket(len(seqs)), width, k, len(seqs), who)

    def applies(self, seqs: list[SeqId], query_lens: list[int], rows: np.ndarray) -> bool:
        r = self.runner
        if not self.enabled or len(seqs) > MAX_BATCH or any(n != 1 for n in query_lens):
            return False
        if r.model.model.layers[0].self_attn.attention is not kernel_attention:  # type: ignore[union-attr]
            return False
        tables = [r.blocks.table(s) for s in seqs]
        for seq, t in zip(seqs, tables, strict=True):
            policy = r.kv.policy(seq)
            if not policy.graphable:
                return False
            if policy.selects:
                if r.hbf.dense_layers >= r.blocks.num_layers or not r.digests.has(seq):
                    return False
                if self._room(seq, t.num_blocks) <= 0:
                    return False  # a context within its window reads every block: eager
            if r.tiers.archive is not None and r.kv.archive_only(seq):
                return False  # some block is in the archive only: the eager path stages it
        key = self._key(seqs, tables)
        self._applied = key  # `run` replays it (the step's tables do not change in between)
        if len(key) == 2 or key in self._graphs:
            return True
        # An HBF batch's graph belongs to its sessions: made the second time the batch comes.
        if key in self._seen:
            return True
        self._seen[key] = None
        while len(self._seen) > 2 * MAX_GRAPHS:
            self._seen.popitem(last=False)
        return False

    @torch.inference_mode()
    def run(self, step: _Step, ids: list[int]) -> torch.Tensor:
        """The step's forward: hidden states [len(seqs), hidden]. The step's blocks are already
        appended; `step.rows`: [L, B] the new tokens' rows."""
        r = self.runner
        seqs, rows = step.seqs, step.rows
        tables = [r.blocks.table(s) for s in seqs]
        b = len(seqs)
        key, self._applied = self._applied, None
        assert key is not None, "run() follows applies() for the same step"
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._allocate(key)
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        if g.copied is not None:
            g.copied.synchronize()  # the staging buffers are free again (normally long since)
        nl, bb = r.blocks.num_layers, g.batch
        small = g.small_host.numpy()
        small[: nl * bb].reshape(nl, bb)[:, :b] = rows
        small[: nl * bb].reshape(nl, bb)[:, b:] = 0  # padding entries write into the null slot
        nblocks, tail, tok, pos, ends, room, take = small[nl * bb :].reshape(SMALL, bb)
        bs = r.blocks.block_size
        for i, t in enumerate(tables):
            nblocks[i], tail[i] = t.num_blocks, t.num_tokens - (t.num_blocks - 1) * bs
            tok[i], pos[i], ends[i] = ids[i], t.num_tokens - 1, t.num_tokens
        nblocks[b:], tail[b:], tok[b:], pos[b:], ends[b:] = 1, 1, 0, 0, 1
        room[:], take[:] = 0, 0
        if g.hbf is not None:
            self._hbf_inputs(g, tables, room, take)
        changed = self._fill_tables(g, seqs, tables)
        nonblocking = self.capture
        g.small.copy_(g.small_host, non_blocking=nonblocking)
        if changed:
            g.locs.copy_(g.locs_host, non_blocking=nonblocking)
        if self.capture:
            g.copied = torch.cuda.Event()
            g.copied.record()
        if g.graph is None and self.capture:
            self._capture(g)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.hidden = self._forward(g)
        self.replays += 1
        self._count_reads(g, seqs, tables)
        step.graph = g
        assert g.hidden is not None
        return g.hidden[:b]

    def resolve(self, step: _Step) -> None:
        """After a replayed step (and the launch of its logits): its HBF entries' picks go to the
        host as (layer, block) keys for promotion, their entropies to their sessions' states (left
        on the device). With `lag` the picks are copied out asynchronously and promoted during
        the next step (`take_lagged`: the host's planning then overlaps the device's work);
        without, the host waits for them here and `step.selected` gets them."""
        g = step.graph
        if g is None or g.hbf is None:
            return
        r, hb = self.runner, g.hbf
        for e, seq in enumerate(hb.seqs):
            r.kv.selection(seq).entropies.append(hb.entropy[e].clone())
        if hb.picked_host is None:
            hb.picked_host = torch.empty(hb.picked.shape, dtype=hb.picked.dtype, pin_memory=self.capture)
        hb.picked_host.copy_(hb.picked, non_blocking=self.capture)
        done = torch.cuda.Event() if self.capture else None
        if done is not None:
            done.record()
        if self.lag:  # counted later, against where this step read (the tables change meanwhile)
            seen = g.locs_host.numpy()[:, list(hb.entries), :].copy()  # [L, E, W]
            self._lagged = _Pending(hb.seqs, tuple(hb.rooms), hb.picked_host, done, seen)
        else:  # promote counts them against the tables, unchanged since the step
            step.selected.update(self._keys(_Pending(hb.seqs, tuple(hb.rooms), hb.picked_host, done, None)))

    def take_lagged(self) -> dict[SeqId, np.ndarray]:
        """The previous replayed step's HBF picks as (layer, block) keys per session, their reads
        counted as that step made them (against the locations it read), for promotion now; {} if
        none wait. Called during the next step, or before anything changes the sessions' tables."""
        pending, self._lagged = self._lagged, None
        return {} if pending is None else {s: k[0] for s, k in self._keys(pending, count=True).items()}

    def _keys(self, p: _Pending, count: bool = False) -> dict[SeqId, list[np.ndarray]]:
        r = self.runner
        if p.done is not None:
            p.done.synchronize()  # normally long since
        picked = p.picked.numpy()  # [Ls, E, Hkv, n]
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        dense = r.hbf.dense_layers
        layers = np.arange(dense, r.blocks.num_layers, dtype=np.int64)[:, None, None]
        out: dict[SeqId, list[np.ndarray]] = {}
        for e, seq in enumerate(p.seqs):
            if not r.blocks.has(seq):
                continue  # released since
            n = sinks + p.rooms[e] + recent
            blocks = picked[:, e, :, :n]  # [Ls, Hkv, n]
            keys = blocks + layers * r.blocks.table(seq).capacity
            if count:
                assert p.seen is not None
                where = np.take_along_axis(p.seen[dense:, e, None, :], blocks.reshape(len(blocks), 1, -1), axis=2)
                r.kv.promoter.count_selected(seq, keys.ravel(), where.reshape(keys.shape).ravel() >= 0)
            out[seq] = [keys.ravel()]
        return out

    def _hbf_inputs(self, g: _Graph, tables: list[BlockTable], room: np.ndarray, take: np.ndarray) -> None:
        """Each HBF entry's room and anchors taken (the small buffer), and its anchors copied into
        the graph's buffer when they changed."""
        r, hb = self.runner, g.hbf
        assert hb is not None
        dense, a = r.hbf.dense_layers, hb.anchors.shape[-1]
        sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
        hb.rooms = []
        for e, (i, seq) in enumerate(zip(hb.entries, hb.seqs, strict=True)):
            state = r.kv.selection(seq)
            budget = max(1, state.window_tokens // r.blocks.block_size)
            room[i] = self._room(seq, tables[i].num_blocks)
            hb.rooms.append(int(room[i]))
            first = state.head_anchors.get(dense)
            width = min(a, first.shape[1]) if first is not None else 0
            take[i] = min(int((budget - sinks - recent) * r.hbf.anchor_share), width)
            if hb.versions[e] == state.anchors_version:
                continue
            hb.versions[e] = state.anchors_version
            hb.anchors[:, e].zero_()
            for layer in range(dense, r.blocks.num_layers):
                anchors = state.head_anchors.get(layer)
                if anchors is not None:
                    m = min(a, anchors.shape[1])
                    hb.anchors[layer - dense, e, :, :m].copy_(anchors[:, :m])

    def _allocate(self, key: tuple) -> _Graph:
        r = self.runner
        nl = r.blocks.num_layers
        batch, width = key[0], key[1]
        pin = self.capture
        locs_host = torch.zeros((nl, batch, width), dtype=torch.int32, pin_memory=pin)
        small_host = torch.zeros(nl * batch + SMALL * batch, dtype=torch.int64, pin_memory=pin)
        dev = r.device
        g = _Graph(batch, width, locs_host, small_host, locs_host.to(dev, copy=True), small_host.to(dev, copy=True))
        if len(key) > 2:
            k, real, who = key[2], key[3], key[4]
            hkv = r.hbm.k.shape[0]
            sinks, recent = base_sizes(r.hbf, r.blocks.block_size)
            ls, e = nl - r.hbf.dense_layers, len(who)
            most = max(1, r.hbf.window_max_tokens // r.blocks.block_size - sinks - recent)  # probe_anchors' width
            n = sinks + k + recent
            g.hbf = _Hbf(
                entries=tuple(i for i, _, _ in who),
                seqs=tuple(seq for _, seq, _ in who),
                k=k,
                anchors=torch.zeros((ls, e, hkv, most), dtype=torch.int64, device=dev),
                picked=torch.zeros((ls, e, hkv, sinks + k + recent), dtype=torch.int64, device=dev),
                entropy=torch.zeros(e, dtype=torch.float32, device=dev),
                mixed=e < real,
                index=torch.tensor([i for i, _, _ in who], dtype=torch.int64, device=dev),
                heads=torch.zeros((batch, hkv, max(n, width) if e < real else n), dtype=torch.int32, device=dev),
                nblocks=torch.ones((batch, hkv), dtype=torch.int32, device=dev),
                versions=[-1] * e,
            )
        return g

    def _fill_tables(self, g: _Graph, seqs: list[SeqId], tables: list[BlockTable]) -> bool:
        """Write the locations of the sessions whose tables changed since this bucket last saw them
        at their batch index; returns whether any did."""
        locs = g.locs_host.numpy()
        changed = False
        want = [(s, t.version, t.num_blocks) for s, t in zip(seqs, tables, strict=True)]
        want += [(SeqId(-1), 0, 0)] * (g.batch - len(seqs))
        if len(g.tables) != g.batch:
            g.tables = [(SeqId(-2), 0, 0)] * g.batch
            g.below = [0] * g.batch
        whole = set(range(g.batch)) - set(g.hbf.entries if g.hbf is not None else ())
        dense = self.runner.hbf.dense_layers
        for i, entry in enumerate(want):
            if g.tables[i] == entry:
                continue
            changed = True
            g.tables[i] = entry
            if i >= len(tables):
                locs[:, i, :] = 0
                g.below[i] = 0
                continue
            t, nb = tables[i], entry[2]
            where = t.all_locations()
            in_hbm = where >= 0
            locs[:, i, :nb] = where
            locs[:, i, nb:] = 0
            read = in_hbm if i in whole else in_hbm[:dense]  # the layers read whole: HBF's dense ones
            g.below[i] = read.size - int(np.count_nonzero(read))
        return changed

    def _forward(self, g: _Graph) -> torch.Tensor:
        r = self.runner
        nl, b = r.blocks.num_layers, g.batch
        ids, positions = g.small[nl * b + 2 * b : nl * b + 4 * b].view(2, b)
        return r.model(ids, positions, _GraphKV(r.pools, r, g))

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture. The
        warm-up runs write this step's K/V and digests, the same values the replay writes again."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(g)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.hidden = self._forward(g)
        g.graph = graph
        self.captures += 1

    def _count_reads(self, g: _Graph, seqs: list[SeqId], tables: list[BlockTable]) -> None:
        """Every block of every layer an exact entry reads, and of an HBF entry's dense layers, was
        read; those in DDR over PCIe (counted when the tables were written). An HBF entry's
        selections are counted with their promotion (`resolve`)."""
        r = self.runner
        hbf = set(g.hbf.entries) if g.hbf is not None else set()
        for i, (seq, t) in enumerate(zip(seqs, tables, strict=True)):
            layers = r.hbf.dense_layers if i in hbf else r.blocks.num_layers
            r.tiers.count_reads(seq, t.num_blocks * layers, g.below[i])
