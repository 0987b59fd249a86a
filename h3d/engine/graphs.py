"""Decode steps replayed as CUDA graphs: the whole forward of an `exact` decode step is one launch.

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
  [B], copied every step (a few hundred bytes).

Padding entries of the batch feed token 0 at position 0, write into the null slot (row 0, never
read: lists mask it) and attend to that one token; their outputs are dropped.

When it applies (`applies`): every chunk is one decode token, every session is under `exact` (HBF
selection changes its lists' lengths every step: it stays on the eager path), and every block is
in HBM or DDR (none to stage from the archive). Anything else
runs eagerly (`h3d.engine.runner._Step`).

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

from h3d.kv.attention import LayerKV, Pools, kernel_attention
from h3d.kv.blocks import NONE, BlockTable, SeqId
from h3d.kv.triton_decode import paged_write

if TYPE_CHECKING:
    from h3d.engine.runner import ModelRunner

MAX_BATCH = 256
MAX_GRAPHS = 32  # least recently used graphs beyond this are dropped (their memory returns to the pool)


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


@dataclass(slots=True)
class _Graph:
    """One bucket's static buffers, and its captured graph (None on the CPU)."""

    batch: int
    width: int
    locs_host: torch.Tensor  # [L, B, W] int32 (pinned on CUDA)
    small_host: torch.Tensor  # [L * B + 5 * B] int64 (pinned on CUDA)
    locs: torch.Tensor  # device copies of the two
    small: torch.Tensor
    hidden: torch.Tensor | None = None  # the forward's output [B, hidden] (static under a graph)
    graph: torch.cuda.CUDAGraph | None = None
    tables: list[tuple[SeqId, int, int]] = field(default_factory=list)  # per entry: (seq, version, blocks) in locs
    below: list[int] = field(default_factory=list)  # per entry: its blocks in DDR (all layers)
    copied: torch.cuda.Event | None = None  # the last input copy (the staging is reused after it)


class _GraphKV:
    """The static-buffer view of the KV cache for one decode step (a `StepKV`)."""

    def __init__(self, pools: Pools, runner: ModelRunner, g: _Graph) -> None:
        nl, b = runner.blocks.num_layers, g.batch
        hkv = runner.hbm.k.shape[0]
        self.pools = pools
        self.runner = runner
        self.rows = g.small[: nl * b].view(nl, b)
        nblocks, tail, _, _, ends = g.small[nl * b :].view(5, b)
        self.seq_ends = ends
        self.nblocks = nblocks.to(torch.int32)[:, None].expand(-1, hkv)
        self.tail = tail.to(torch.int32)
        self.locs = g.locs
        self.hkv = hkv
        self.query_lens = (1,) * b

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        table = self.locs[index]  # [B, W]
        lists = (table[:, None, :].expand(-1, self.hkv, -1), self.nblocks, self.tail)
        return LayerKV(
            query_lens=self.query_lens,
            kv_lens=self.query_lens,  # not read: attention reads `lists`
            runs=tuple([] for _ in self.query_lens),
            tables=lambda: table,
            lists=lists,
        )

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        paged_write(k, v, (self.pools.k[0], self.pools.k[1]), (self.pools.v[0], self.pools.v[1]), self.rows[index])


class DecodeGraphs:
    """The runner's CUDA graphs of `exact` decode steps (see the module docstring)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.capture = runner.device.type == "cuda"
        # On by default on CUDA; tests turn it on on the CPU (with `kernel_attention`).
        self.enabled = self.capture
        self._graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.replays = 0  # steps run through a bucket (counted on the CPU too)
        self.captures = 0

    def applies(self, seqs: list[SeqId], query_lens: list[int], rows: np.ndarray) -> bool:
        r = self.runner
        if not self.enabled or len(seqs) > MAX_BATCH or any(n != 1 for n in query_lens):
            return False
        if r.model.model.layers[0].self_attn.attention is not kernel_attention:  # type: ignore[union-attr]
            return False
        for seq in seqs:
            if r.selection[seq].policy != "exact":
                return False
            if r.tiers.archive is None:
                continue  # every block is in HBM or DDR
            t = r.blocks.table(seq)
            nb = t.num_blocks
            if ((t.hbm[:, :nb] == NONE) & (t.ddr[:, :nb] == NONE)).any():
                return False  # some block is in the archive only: the eager path stages it
        return True

    @torch.inference_mode()
    def run(self, seqs: list[SeqId], ids: list[int], rows: np.ndarray) -> torch.Tensor:
        """The step's forward: hidden states [len(seqs), hidden]. `rows`: [L, B] the new tokens' HBM
        rows (the blocks are already appended)."""
        r = self.runner
        tables = [r.blocks.table(s) for s in seqs]
        b = len(seqs)
        key = (batch_bucket(b), width_bucket(max(t.num_blocks for t in tables)))
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._allocate(*key)
            while len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        if g.copied is not None:
            g.copied.synchronize()  # the staging buffers are free again (normally long since)
        nl, bb = r.blocks.num_layers, g.batch
        small = g.small_host.numpy()
        small[: nl * bb].reshape(nl, bb)[:, :b] = rows
        small[: nl * bb].reshape(nl, bb)[:, b:] = 0  # padding entries write into the null slot
        nblocks, tail, tok, pos, ends = small[nl * bb :].reshape(5, bb)
        bs = r.blocks.block_size
        for i, t in enumerate(tables):
            nblocks[i], tail[i] = t.num_blocks, t.num_tokens - (t.num_blocks - 1) * bs
            tok[i], pos[i], ends[i] = ids[i], t.num_tokens - 1, t.num_tokens
        nblocks[b:], tail[b:], tok[b:], pos[b:], ends[b:] = 1, 1, 0, 0, 1
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
        assert g.hidden is not None
        return g.hidden[:b]

    def _allocate(self, batch: int, width: int) -> _Graph:
        r = self.runner
        nl = r.blocks.num_layers
        pin = self.capture
        locs_host = torch.zeros((nl, batch, width), dtype=torch.int32, pin_memory=pin)
        small_host = torch.zeros(nl * batch + 5 * batch, dtype=torch.int64, pin_memory=pin)
        dev = r.device
        return _Graph(batch, width, locs_host, small_host, locs_host.to(dev, copy=True), small_host.to(dev, copy=True))

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
            hbm, ddr = t.hbm[:, :nb], t.ddr[:, :nb]
            in_hbm = hbm >= 0
            locs[:, i, :nb] = np.where(in_hbm, hbm, -ddr - 1)
            locs[:, i, nb:] = 0
            g.below[i] = in_hbm.size - int(np.count_nonzero(in_hbm))
        return changed

    def _forward(self, g: _Graph) -> torch.Tensor:
        r = self.runner
        nl, b = r.blocks.num_layers, g.batch
        ids, positions = g.small[nl * b + 2 * b : nl * b + 4 * b].view(2, b)
        return r.model(ids, positions, _GraphKV(r.pools, r, g))

    def _capture(self, g: _Graph) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels), then capture. The
        warm-up runs write this step's K/V, the same values the replay writes again."""
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
        """Every block of every layer was read; those in DDR over PCIe (counted when the tables
        were written)."""
        nl = self.runner.blocks.num_layers
        for i, (seq, t) in enumerate(zip(seqs, tables, strict=True)):
            self.runner.tiers.count_reads(seq, t.num_blocks * nl, g.below[i])
