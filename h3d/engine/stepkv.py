"""How a planned step's forward sees the KV cache (each class is a `StepKV`, `h3d.kv.attention`).

The planner (`ModelRunner.plan`) decided the step's allocations, its path and each chunk's
selection; these carry the plan out inside the forward, layer by layer, and record what they read
in the step's report (`StepReport.reads`, `.picks`) for the commit to count and promote. They
never count, promote or change a table themselves; the only move during a step is the host
path's staging of archived blocks (`TierManager.stage`), just before the layer that reads them.

- `HostStepKV` (`Path.HOST`): each layer's blocks as runs the host found, a prefill chunk's
  own K/V as computed (`fresh`), a decode token's HBF selection made on the device and listed on
  the host. Every prefill, and any step that must stage.
- `DeviceStepKV` (`Path.DEVICE`): a decode step on the GPU that no layer waits on the host for:
  every layer's locations go to the device in one copy, selections and lists stay there; the
  picks reach the host once, after the forward (`resolve`).
- `RewriteKV`: one block's K/V computed again (a damaged archive record), reading only what
  precedes it.
(`Path.GRAPH`'s is `h3d.engine.graphs._GraphKV`, on a captured step's static buffers.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from h3d.engine.step import Reads, StepPlan, StepReport
from h3d.hbf.policy import probe_anchors
from h3d.kernels.copies import paged_write, to_device
from h3d.kv.attention import LayerKV, head_major, window_lists
from h3d.kv.blocks import SeqId, first_blocks, runs_of

if TYPE_CHECKING:
    from h3d.engine.runner import ModelRunner

_NO_FRESH: tuple[int, torch.Tensor, torch.Tensor] = (-1, torch.empty(0), torch.empty(0))


class _Writes:
    """What the eager paths share: the new tokens' K/V into their rows, and into the digests of
    the sessions whose policy keeps them."""

    def __init__(self, runner: ModelRunner, plan: StepPlan, report: StepReport, seq_ends: torch.Tensor) -> None:
        self.runner = runner
        self.plan = plan
        self.report = report
        self.pools = runner.pools
        self.seq_ends = seq_ends
        self.seqs = plan.seqs
        self.starts = [c.start for c in plan.chunks]
        self.query_lens = plan.query_lens
        self.offsets = np.concatenate(([0], np.cumsum(self.query_lens)[:-1])).tolist()
        self.kv_lens = tuple(c.start + len(c.token_ids) for c in plan.chunks)
        self._fresh: tuple[int, torch.Tensor, torch.Tensor] = _NO_FRESH  # (layer, k, v) of the last write
        self._device_rows: torch.Tensor | None = None
        # Prefill only: attention takes every chunk's K/V as computed, so the step's writes may
        # trail its compute on the runner's transfer stream (CUDA).
        self.write_behind = all(n > 1 for n in self.query_lens)
        self.wrote_behind = False
        self.layers_written = 0  # layers whose K/V `write` took (a long forward's progress)

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._fresh = (index, k, v)
        self.layers_written += 1
        self._write_rows(index, k, v)
        r = self.runner
        if not r.digests.keeps(index):
            return  # a sliding-window or dense layer keeps no digests (it never selects)
        for seq, start, off, n in zip(self.seqs, self.starts, self.offsets, self.query_lens, strict=True):
            if r.kv.policy(seq).keeps_digests:  # else built on a switch to a policy that keeps them
                r.digests.update(seq, index, start, k[off : off + n])

    def _write_rows(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        r, pools = self.runner, self.pools
        rows = self.plan.rows[index]
        if r.device.type == "cuda" or r.plan_on_device:  # every row in one launch, DDR's over PCIe in place
            if self._device_rows is None:
                rows_all = np.ascontiguousarray(self.plan.rows)  # (an append's rows may come in column order)
                self._device_rows = to_device(rows_all, r.device)  # all layers: one copy a step
            lists = (k, v, (pools.k[0], pools.k[1]), (pools.v[0], pools.v[1]), self._device_rows[index])
            behind = r.transfer_stream if self.write_behind else None
            if behind is None:
                paged_write(*lists)
                return
            # Nothing in this step reads these rows (each chunk attends to its K/V as computed):
            # the copies, DDR's over PCIe, run beside the next layers' compute (`execute` joins
            # the streams at the step's end).
            behind.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(behind):
                paged_write(*lists)
            for t in (k, v, self._device_rows):
                t.record_stream(behind)  # kept until the copies are done
            self.wrote_behind = True
        elif not (rows < 0).any():
            r.hbm.write(to_device(rows, r.device), k, v)
        else:
            in_hbm = rows >= 0
            for pool, sel, pool_rows in (
                (r.hbm, np.flatnonzero(in_hbm), rows[in_hbm]),
                (r.ddr, np.flatnonzero(~in_hbm), -rows[~in_hbm] - 1),
            ):
                if len(sel):
                    idx = to_device(sel, r.device)
                    dev = pool.k.device
                    pool.write(to_device(pool_rows, dev), k[idx].to(dev), v[idx].to(dev))

    def take_fresh(self, index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's K/V as just computed, for a prefill chunk's attention (once: the attention's
        own reference is the last, freed with it)."""
        fresh = self._fresh[1:] if self._fresh[0] == index and any(n > 1 for n in self.query_lens) else None
        self._fresh = _NO_FRESH
        return fresh


class HostStepKV(_Writes):
    """`Path.HOST`: each layer planned by the host as it runs (see the module docstring)."""

    def __init__(self, runner: ModelRunner, plan: StepPlan, report: StepReport, seq_ends: torch.Tensor) -> None:
        super().__init__(runner, plan, report, seq_ends)
        self.picked: dict[SeqId, list[np.ndarray]] = {}  # what selections read, as (layer, block) keys

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        r, plan, times = self.runner, self.plan, self.runner.host_times
        window = r.windows[index]
        t0, waited = time.perf_counter(), times.digests_s
        if window is None:
            chosen = [self._select(i, index, q, scale) if plan.selects[i] else None for i in range(len(self.seqs))]
        else:  # a sliding-window layer: a decode token reads its window's blocks, whatever the policy
            chosen = [self._window(i, window) for i in range(len(self.seqs))]
        times.select_s += time.perf_counter() - t0 - (times.digests_s - waited)  # (the digests' wait apart)
        times.layers += 1
        if plan.staging:  # from the archive, only what the selections read (a resumed session's first steps)
            only = {seq: np.unique(sel) for seq, sel in zip(self.seqs, chosen, strict=True) if sel is not None}
            t0, before = time.perf_counter(), r.tiers.counters.ssd_read_count
            r.tiers.stage(index, self.seqs, plan.protect, only=only)
            times.stage_s += time.perf_counter() - t0
            times.staged_blocks += r.tiers.counters.ssd_read_count - before
        runs: list = []
        kv_lens: list[int] = []
        locs: list[np.ndarray | None] = []
        heads: list[np.ndarray | None] = []  # per-KV-head locations of a per-head selection
        for i, seq in enumerate(self.seqs):
            t = r.blocks.table(seq)
            sel = chosen[i]
            if plan.probes[i] and window is None:  # (a sliding layer never selects: no anchors, no gather)
                self._probe(i, index, q, scale)
            if sel is None:
                seq_runs = r.blocks.runs(seq, index)
                if self.query_lens[i] > 1:  # a chunk attends to its own K/V as written (`fresh`)
                    seq_runs = first_blocks(seq_runs, -(-self.starts[i] // r.blocks.block_size))
                kv_lens.append(self.kv_lens[i])
                heads.append(None)
                total = sum(c for _, _, c in seq_runs)
                staged = r.tiers.staged_reads(t.ids[index, :total])  # the runs cover the first `total` blocks
                self.report.reads.append(Reads(seq, total, sum(c for tier, _, c in seq_runs if tier), staged))
            else:
                union = sel if sel.ndim == 1 else np.unique(sel)  # what must be readable (and promoted)
                # One key per KV head that reads the block (promotion counts the heads' bytes).
                heads_read = np.tile(sel, r.hbm.k.shape[0]) if sel.ndim == 1 else sel.ravel()
                self.picked.setdefault(seq, []).append(heads_read + index * t.capacity)
                where = t.locations(index)
                seq_runs = runs_of(where[union])
                kv_lens.append(self.kv_lens[i] - (t.num_blocks - sel.shape[-1]) * r.blocks.block_size)
                heads.append(None if sel.ndim == 1 else where[sel])
                sel = union
            runs.append(seq_runs)
            locs.append(sel)
        seqs = self.seqs

        def tables() -> torch.Tensor:
            full = [r.blocks.table(s).locations(index) for s in seqs]
            return r.padded_locations([f if sel is None else f[sel] for f, sel in zip(full, locs, strict=True)])

        fresh = self.take_fresh(index)
        if all(h is None for h in heads):
            return LayerKV(
                query_lens=self.query_lens,
                kv_lens=tuple(kv_lens),
                runs=tuple(runs),
                tables=tables,
                fresh=fresh,
                window=window,
            )
        hkv = r.hbm.k.shape[0]

        def head_tables() -> torch.Tensor:
            full = [r.blocks.table(s).locations(index) for s in seqs]
            rows = [np.broadcast_to(f if sel is None else f[sel], (hkv, len(f if sel is None else sel))) if h is None
                    else h for f, sel, h in zip(full, locs, heads, strict=True)]  # fmt: skip
            out = np.zeros((len(rows), hkv, max(x.shape[1] for x in rows)), dtype=np.int64)
            for i, x in enumerate(rows):
                out[i, :, : x.shape[1]] = x
            return to_device(out, r.device)

        return LayerKV(
            query_lens=self.query_lens,
            kv_lens=tuple(kv_lens),
            runs=tuple(runs),
            tables=tables,
            head_locs=tuple(heads),
            head_tables=head_tables,
            fresh=fresh,
        )

    def _window(self, i: int, window: int) -> np.ndarray | None:
        """A decode token's blocks in a sliding-window layer: those that hold its last `window`
        positions (None: all of them; a chunk reads every block, masked by the window)."""
        if self.query_lens[i] != 1:
            return None
        first = max(0, self.kv_lens[i] - window) // self.runner.blocks.block_size
        return np.arange(first, self.runner.blocks.table(self.seqs[i]).num_blocks) if first else None

    def _select(self, i: int, index: int, q: torch.Tensor, scale: float) -> np.ndarray | None:
        """Sequence i's selection in this layer ([n] or [Hkv, n] block indices; None: every block)."""
        r, seq = self.runner, self.seqs[i]
        if not r.digests.keeps(index):
            return None  # a dense layer: every block (it keeps no digests)
        t = r.blocks.table(seq)
        state = r.kv.selection(seq)
        t0 = time.perf_counter()
        digests = r.digests.get(seq, index, t.num_blocks)  # (a resumed session's: perhaps still being read)
        r.host_times.digests_s += time.perf_counter() - t0
        sel = state.policy.select(
            state, r.hbf, index, q[self.offsets[i]], digests, t.num_blocks, r.blocks.block_size, scale
        )
        return sel.cpu().numpy() if isinstance(sel, torch.Tensor) else sel

    def _probe(self, i: int, index: int, q: torch.Tensor, scale: float) -> None:
        """HBF's prompt probe (`probe_anchors`) of chunk i, which ends its prompt: its last queries
        against every key so far, the chunk's own taken as written (`fresh`), the earlier ones
        gathered from their blocks."""
        r = self.runner
        seq, start, n, off = self.seqs[i], self.starts[i], self.query_lens[i], self.offsets[i]
        keys = [self._fresh[1][off : off + n].transpose(0, 1)]  # [Hkv, n, D]
        if start:
            loc = r.blocks.table(seq).locations(index)[: -(-start // r.blocks.block_size)]
            keys.insert(0, head_major(self.pools.k, loc, start))  # [Hkv, start, D] (a view where it can)
        probe_anchors(r.kv.selection(seq), r.hbf, index, q[off : off + n], keys, r.blocks.block_size, scale)

    def resolve(self) -> None:
        """After the forward: the selections' reads into the report."""
        self.report.picks.update({s: np.concatenate(keys) for s, keys in self.picked.items()})


class DeviceStepKV(_Writes):
    """`Path.DEVICE`: a decode step whose every layer reads from the device (see the module
    docstring). Its plan's locations, the new tokens' rows and the kernel's list lengths go to
    the device in one copy at the step's start."""

    def __init__(self, runner: ModelRunner, plan: StepPlan, report: StepReport, seq_ends: torch.Tensor) -> None:
        super().__init__(runner, plan, report, seq_ends)
        r = runner
        bs, hkv = r.blocks.block_size, r.hbm.k.shape[0]
        locs = plan.locations
        assert locs is not None, "a device-planned step carries its locations"
        nbs = np.asarray([r.blocks.table(s).num_blocks for s in self.seqs])
        tail = np.asarray(self.kv_lens, dtype=np.int64) - (nbs - 1) * bs
        packed = torch.from_numpy(np.concatenate([locs.ravel(), plan.rows.ravel(), nbs, tail]))
        packed = to_device(packed, r.device)  # the step's one copy to the device
        n_locs, n_rows = locs.size, plan.rows.size
        self.locs = packed[:n_locs].view(locs.shape)
        self.rows = packed[n_locs : n_locs + n_rows].view(plan.rows.shape)
        nblocks = packed[n_locs + n_rows : n_locs + n_rows + len(nbs)]
        self.tail = packed[n_locs + n_rows + len(nbs) :].to(torch.int32)
        self.full = (self.locs.to(torch.int32), nblocks.to(torch.int32)[:, None].expand(-1, hkv))
        self.hkv = hkv
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (batch index, layer, [Hkv, n] blocks)

    def _write_rows(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        pools = self.pools  # rows already on the device; DDR rows written in place
        paged_write(k, v, (pools.k[0], pools.k[1]), (pools.v[0], pools.v[1]), self.rows[index])

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        r = self.runner
        tables, nblocks = self.full[0][index], self.full[1]  # [B, W], [B, Hkv]
        window = r.windows[index]
        head = None
        if window is not None:  # a sliding-window layer: its window's blocks, whatever the policy
            lists, head = window_lists(tables, nblocks[:, 0], self.tail, window, r.blocks.block_size, self.hkv)
            kv_lens = tuple(self.kv_lens)
        else:
            lists, kv_lens = self._select(index, q, scale, tables, nblocks)
        return LayerKV(
            query_lens=self.query_lens,
            kv_lens=kv_lens,
            runs=tuple([] for _ in self.seqs),  # not planned on the host: attention reads `lists`
            tables=lambda: tables,
            lists=lists,
            head=head,
        )

    def _select(
        self, index: int, q: torch.Tensor, scale: float, tables: torch.Tensor, nblocks: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], tuple[int, ...]]:
        """The kernel's lists of a layer that may select (each selecting sequence's picks, the
        others' whole tables) and the tokens each list holds."""
        r = self.runner
        picked: dict[int, torch.Tensor] = {}
        kv_lens = list(self.kv_lens)
        for i, seq in enumerate(self.seqs):
            if not self.plan.selects[i] or not r.digests.keeps(index):  # (a dense layer keeps no digests)
                continue
            t = r.blocks.table(seq)
            state = r.kv.selection(seq)
            digests = r.digests.get(seq, index, t.num_blocks)
            sel = state.policy.select(state, r.hbf, index, q[i], digests, t.num_blocks, r.blocks.block_size, scale)
            if sel is None:
                continue
            blocks = sel if isinstance(sel, torch.Tensor) else to_device(sel, q.device)
            blocks = blocks.expand(self.hkv, -1) if blocks.dim() == 1 else blocks  # [Hkv, n]
            picked[i] = blocks
            self.pending.append((i, index, blocks))
            kv_lens[i] -= (t.num_blocks - blocks.shape[1]) * r.blocks.block_size
        heads = tables[:, None, :].expand(-1, self.hkv, -1)
        if picked:
            heads = heads.clone()
            nblocks = nblocks.clone()
            for i, blocks in picked.items():
                heads[i, :, : blocks.shape[1]] = tables[i][blocks]
                heads[i, :, blocks.shape[1] :] = 0
                nblocks[i] = blocks.shape[1]
        return (heads, nblocks, self.tail), tuple(kv_lens)

    def resolve(self) -> None:
        """After the forward: the selections to the host (one copy), as (layer, block) keys into the
        report's picks; the reads of the layers that selected nothing (every block) into its reads."""
        r, plan, report = self.runner, self.plan, self.report
        assert plan.locations is not None
        selecting = np.zeros((len(self.seqs), r.blocks.num_layers), dtype=bool)  # [B, L]
        if self.pending:
            flat = torch.cat([b.reshape(-1) for _, _, b in self.pending]).cpu().numpy()
            owner = np.fromiter((i for i, _, _ in self.pending), np.int64, len(self.pending))
            layer = np.fromiter((layer for _, layer, _ in self.pending), np.int64, len(self.pending))
            sizes = np.fromiter((b.numel() for _, _, b in self.pending), np.int64, len(self.pending))
            width = np.fromiter((r.blocks.table(s).capacity for s in self.seqs), np.int64, len(self.seqs))
            keys = flat + np.repeat(layer * width[owner], sizes)
            selecting[owner, layer] = True
            of = np.repeat(owner, sizes)
            for i, seq in enumerate(self.seqs):
                mine = keys if len(self.seqs) == 1 else keys[of == i]
                if len(mine):
                    report.picks[seq] = mine
        for i, seq in enumerate(self.seqs):
            nb = r.blocks.table(seq).num_blocks
            read = r.blocks.decode_reads(seq) & ~selecting[i][:, None]  # [L, nb]: a window layer's: its window's
            where = plan.locations[:, i, :nb][read]  # nothing moved during the step
            report.reads.append(Reads(seq, where.size, int((where < 0).sum())))


class RewriteKV(HostStepKV):
    """A forward that computes one block's K/V again: its tokens attend to the blocks before it
    (staged from the archive where needed) and to themselves; nothing past the block is read."""

    def __init__(self, runner: ModelRunner, plan: StepPlan, report: StepReport, block: int) -> None:
        chunk = plan.chunks[0]
        ends = torch.full((len(chunk.token_ids),), chunk.start + len(chunk.token_ids), device=runner.device)
        super().__init__(runner, plan, report, ends)
        self.block = block
        self.write_behind = False  # its attention reads the rewritten block from the pool

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        r = self.runner
        seq = self.seqs[0]
        r.tiers.stage(index, self.seqs, self.plan.protect, upto={seq: self.block + 1})
        locations = r.blocks.table(seq).locations(index)[: self.block + 1]
        return LayerKV(
            query_lens=self.query_lens,
            kv_lens=self.kv_lens,
            runs=(runs_of(locations),),
            tables=lambda: r.padded_locations([locations]),
            window=r.windows[index],
        )
