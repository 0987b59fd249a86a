"""The model runner: turns a step's chunks into one packed forward over the tiered KV cache.

The KV state it reads and writes is the KV cache's (`h3d.kv.cache.KVCache`: pools, block tables,
tiers, digests, selection states); the runner plans and runs a step over it.
A *chunk* is a run of a sequence's tokens whose K/V are not in the cache yet: a prefill chunk of
many tokens or a decode step's one token; both go through the same forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from h3d.config import EngineConfig
from h3d.engine.graphs import DecodeGraphs, _Graph
from h3d.hbf.policy import Exact, HbfConfig, probe_anchors
from h3d.kernels.copies import paged_write
from h3d.kv.attention import LayerKV, Pools, gather_blocks, kernel_attention
from h3d.kv.blocks import SeqId, first_blocks, runs_of
from h3d.kv.cache import KVCache
from h3d.model.llama import CausalLM
from h3d.tiers.archive import Archive


@dataclass(frozen=True, slots=True)
class Chunk:
    """`token_ids` of `seq` to feed now, the first at position `start` (= its cached length).
    `final`: the chunk ends what the session has been given so far (its prompt's end: HBF's
    prefill probes read its last queries, `h3d.hbf.policy.probe_anchors`)."""

    seq: SeqId
    token_ids: tuple[int, ...]
    start: int
    want_logits: bool
    final: bool = True


_NO_FRESH: tuple[int, torch.Tensor, torch.Tensor] = (-1, torch.empty(0), torch.empty(0))


class _Step:
    """One forward's view of the KV cache (implements `h3d.kv.attention.StepKV`)."""

    def __init__(
        self,
        runner: ModelRunner,
        chunks: list[Chunk],
        rows: np.ndarray,
        seq_ends: torch.Tensor,
        protect: dict[SeqId, int],
        graphed: bool = False,
    ) -> None:
        self.runner = runner
        self.pools = runner.pools
        self.seq_ends = seq_ends
        self.seqs = [c.seq for c in chunks]
        self.starts = [c.start for c in chunks]
        self.query_lens = tuple(len(c.token_ids) for c in chunks)
        self.probes = tuple(c.final and len(c.token_ids) > 1 for c in chunks)  # prompt ends: probed
        self.offsets = np.concatenate(([0], np.cumsum(self.query_lens)[:-1])).tolist()
        self.kv_lens = tuple(c.start + len(c.token_ids) for c in chunks)
        self.protect = protect  # seq -> first block written this step (never moved during it)
        self.rows = rows  # [L, N]: >= 0 HBM pool row, else -(DDR row + 1)
        self.has_ddr_rows = bool((rows < 0).any())
        # seq -> what HBF selections read this step, as (layer, block) keys (`BlockTable.capacity`)
        self.selected: dict[SeqId, list[np.ndarray]] = {}
        # Replayed as a CUDA graph (`DecodeGraphs`): this object then only carries the bookkeeping
        # (and the graph it ran, whose HBF picks `DecodeGraphs.resolve` reads after the step).
        self.graphed = graphed
        self.graph: _Graph | None = None
        self.plan = _DevicePlan(self) if not graphed and _DevicePlan.applies(self) else None
        runner.device_planned_steps += self.plan is not None
        self._fresh: tuple[int, torch.Tensor, torch.Tensor] = _NO_FRESH  # (layer, k, v) of the last write
        self._device_rows: torch.Tensor | None = None
        # Prefill only: attention takes every chunk's K/V as computed, so the step's writes may
        # trail its compute on the runner's transfer stream (CUDA).
        self.write_behind = all(n > 1 for n in self.query_lens)
        self.wrote_behind = False

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        if self.plan is not None:
            return self.plan.layer(index, q, scale)
        r = self.runner
        r.tiers.stage(index, self.seqs, self.protect)
        runs: list = []
        kv_lens: list[int] = []
        locs: list[np.ndarray | None] = []
        heads: list[np.ndarray | None] = []  # per-KV-head locations of a per-head selection
        for i, seq in enumerate(self.seqs):
            t = r.blocks.table(seq)
            sel = None
            state = r.kv.selection(seq)
            if self.probes[i] and state.policy.probes_prompt:
                self._probe(i, index, q, scale)
            if self.query_lens[i] == 1 and state.policy.selects:
                digests = r.digests.get(seq, index, t.num_blocks)
                sel = state.policy.select(
                    state, r.hbf, index, q[self.offsets[i]], digests, t.num_blocks, r.blocks.block_size, scale
                )
            if isinstance(sel, torch.Tensor):
                sel = sel.cpu().numpy()
            if sel is None:
                seq_runs = r.blocks.runs(seq, index)
                if self.query_lens[i] > 1:  # a chunk attends to its own K/V as written (`fresh`)
                    seq_runs = first_blocks(seq_runs, -(-self.starts[i] // r.blocks.block_size))
                kv_lens.append(self.kv_lens[i])
                heads.append(None)
                # (A selection's reads are counted with its promotion, `TierManager.promote`.)
                total = sum(c for _, _, c in seq_runs)
                staged = r.tiers.staged_reads(t.ids[index, :total])  # runs cover the first `total` blocks
                r.tiers.count_reads(seq, total, sum(c for tier, _, c in seq_runs if tier), staged=staged)
            else:
                union = sel if sel.ndim == 1 else np.unique(sel)  # what must be readable (and promoted)
                # One key per KV head that reads the block (promotion counts the heads' bytes).
                heads_read = np.tile(sel, r.hbm.k.shape[0]) if sel.ndim == 1 else sel.ravel()
                self.selected.setdefault(seq, []).append(heads_read + index * t.capacity)
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

        fresh = self._fresh[1:] if self._fresh[0] == index and any(n > 1 for n in self.query_lens) else None
        self._fresh = _NO_FRESH  # the attention's own reference is the last: freed with it
        if all(h is None for h in heads):
            return LayerKV(
                query_lens=self.query_lens, kv_lens=tuple(kv_lens), runs=tuple(runs), tables=tables, fresh=fresh
            )
        hkv = r.hbm.k.shape[0]

        def head_tables() -> torch.Tensor:
            full = [r.blocks.table(s).locations(index) for s in seqs]
            rows = [np.broadcast_to(f if sel is None else f[sel], (hkv, len(f if sel is None else sel))) if h is None
                    else h for f, sel, h in zip(full, locs, heads, strict=True)]  # fmt: skip
            out = np.zeros((len(rows), hkv, max(x.shape[1] for x in rows)), dtype=np.int64)
            for i, x in enumerate(rows):
                out[i, :, : x.shape[1]] = x
            return torch.from_numpy(out).to(r.device)

        return LayerKV(
            query_lens=self.query_lens,
            kv_lens=tuple(kv_lens),
            runs=tuple(runs),
            tables=tables,
            head_locs=tuple(heads),
            head_tables=head_tables,
            fresh=fresh,
        )

    def _probe(self, i: int, index: int, q: torch.Tensor, scale: float) -> None:
        """HBF's prompt probe (`probe_anchors`) of chunk i, which ends its prompt: its last queries
        against every key so far, the chunk's own taken as written (`fresh`), the earlier ones
        gathered from their blocks."""
        r = self.runner
        seq, start, n, off = self.seqs[i], self.starts[i], self.query_lens[i], self.offsets[i]
        k = self._fresh[1][off : off + n]  # [n, Hkv, D]
        if start:
            loc = r.blocks.table(seq).locations(index)[: -(-start // r.blocks.block_size)]
            prior = gather_blocks(self.pools.k, torch.from_numpy(loc).to(r.device))[:start]  # [start, Hkv, D]
            k = torch.cat([prior.to(k.dtype), k])
        probe_anchors(r.kv.selection(seq), r.hbf, index, q[off : off + n], k, r.blocks.block_size, scale)

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        r = self.runner
        self._fresh = (index, k, v)
        rows = self.rows[index]
        pools = self.pools
        if self.plan is not None:  # rows already on the device; DDR rows written in place
            paged_write(k, v, (pools.k[0], pools.k[1]), (pools.v[0], pools.v[1]), self.plan.rows[index])
        elif r.device.type == "cuda" or r.plan_on_device:  # every row in one launch, DDR's over PCIe in place
            if self._device_rows is None:
                rows_all = np.ascontiguousarray(self.rows)  # (an append's rows may come in column order)
                self._device_rows = torch.from_numpy(rows_all).to(r.device)  # all layers: one copy a step
            lists = (k, v, (pools.k[0], pools.k[1]), (pools.v[0], pools.v[1]), self._device_rows[index])
            behind = r.transfer_stream if self.write_behind else None
            if behind is None:
                paged_write(*lists)
            else:
                # Nothing in this step reads these rows (each chunk attends to its K/V as computed):
                # the copies, DDR's over PCIe, run beside the next layers' compute (`execute` joins
                # the streams at the step's end).
                behind.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(behind):
                    paged_write(*lists)
                for t in (k, v, self._device_rows):
                    t.record_stream(behind)  # kept until the copies are done
                self.wrote_behind = True
        elif not self.has_ddr_rows:
            r.hbm.write(torch.from_numpy(rows).to(r.device), k, v)
        else:
            in_hbm = rows >= 0
            for pool, sel, pool_rows in (
                (r.hbm, np.flatnonzero(in_hbm), rows[in_hbm]),
                (r.ddr, np.flatnonzero(~in_hbm), -rows[~in_hbm] - 1),
            ):
                if len(sel):
                    idx = torch.from_numpy(sel).to(r.device)
                    dev = pool.k.device
                    pool.write(torch.from_numpy(pool_rows).to(dev), k[idx].to(dev), v[idx].to(dev))
        for seq, start, off, n in zip(self.seqs, self.starts, self.offsets, self.query_lens, strict=True):
            if r.kv.policy(seq).keeps_digests:  # else built on a switch to a policy that keeps them
                r.digests.update(seq, index, start, k[off : off + n])


class _DevicePlan:
    """A decode step on the GPU, planned so that no layer waits on the host: every layer's block
    locations, the new tokens' rows and the kernel's list lengths go to the device in one copy at
    the step's start, and HBF selections stay on the device (the tables the kernel reads are
    gathered there); the host learns the selections once, after the forward (`resolve`), for
    promotion and the counters. Used when every chunk is one token and nothing moves during the
    step: every block the batch may read is in HBM or DDR already (nothing to stage from the
    archive); otherwise the host plans each layer (`_Step.layer`)."""

    @staticmethod
    def applies(step: _Step) -> bool:
        r = step.runner
        if not (r.device.type == "cuda" or r.plan_on_device) or not all(n == 1 for n in step.query_lens):
            return False
        # A block in the archive only: each layer stages its own.
        return r.tiers.archive is None or not any(r.kv.archive_only(seq) for seq in step.seqs)

    def __init__(self, step: _Step) -> None:
        self.step = step
        r = step.runner
        dev = r.device
        bs, hkv = r.blocks.block_size, r.hbm.k.shape[0]
        tables = [r.blocks.table(s) for s in step.seqs]
        nbs = [t.num_blocks for t in tables]
        width = max(nbs)
        locs = np.zeros((r.blocks.num_layers, len(tables), width), dtype=np.int64)  # [L, B, W], 0 pads
        for i, t in enumerate(tables):
            locs[:, i, : t.num_blocks] = t.all_locations()
        kv = np.asarray(step.kv_lens, dtype=np.int64)
        tail = kv - (np.asarray(nbs) - 1) * bs
        packed = torch.from_numpy(np.concatenate([locs.ravel(), step.rows.ravel(), np.asarray(nbs), tail]))
        packed = packed.to(dev)  # the step's one copy to the device
        n_locs, n_rows = locs.size, step.rows.size
        self.host_locs = locs
        self.locs = packed[:n_locs].view(locs.shape)
        self.rows = packed[n_locs : n_locs + n_rows].view(step.rows.shape)
        nblocks = packed[n_locs + n_rows : n_locs + n_rows + len(nbs)]
        self.tail = packed[n_locs + n_rows + len(nbs) :].to(torch.int32)
        self.full = (self.locs.to(torch.int32), nblocks.to(torch.int32)[:, None].expand(-1, hkv))
        self.hkv = hkv
        self.pending: list[tuple[int, int, torch.Tensor]] = []  # (batch index, layer, [Hkv, n] blocks)

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        step, r = self.step, self.step.runner
        tables, nblocks = self.full[0][index], self.full[1]  # [B, W], [B, Hkv]
        picked: dict[int, torch.Tensor] = {}
        kv_lens = list(step.kv_lens)
        for i, seq in enumerate(step.seqs):
            t = r.blocks.table(seq)
            state = r.kv.selection(seq)
            if not state.policy.selects:
                continue
            digests = r.digests.get(seq, index, t.num_blocks)
            sel = state.policy.select(state, r.hbf, index, q[i], digests, t.num_blocks, r.blocks.block_size, scale)
            if sel is None:
                continue
            blocks = sel if isinstance(sel, torch.Tensor) else torch.from_numpy(sel).to(q.device, non_blocking=True)
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
        lists = (heads, nblocks, self.tail)
        return LayerKV(
            query_lens=step.query_lens,
            kv_lens=tuple(kv_lens),
            runs=tuple([] for _ in step.seqs),  # not planned on the host: attention reads `lists`
            tables=lambda: tables,
            lists=lists,
        )

    def resolve(self) -> None:
        """After the forward: the selections to the host (one copy), as (layer, block) keys for
        promotion (which counts their reads); the reads of the layers that selected nothing
        (every block) are counted here."""
        step, r = self.step, self.step.runner
        selecting = np.zeros((len(step.seqs), r.blocks.num_layers), dtype=bool)  # [B, L]
        if self.pending:
            flat = torch.cat([b.reshape(-1) for _, _, b in self.pending]).cpu().numpy()
            owner = np.fromiter((i for i, _, _ in self.pending), np.int64, len(self.pending))
            layer = np.fromiter((layer for _, layer, _ in self.pending), np.int64, len(self.pending))
            sizes = np.fromiter((b.numel() for _, _, b in self.pending), np.int64, len(self.pending))
            width = np.fromiter((r.blocks.table(s).capacity for s in step.seqs), np.int64, len(step.seqs))
            keys = flat + np.repeat(layer * width[owner], sizes)
            selecting[owner, layer] = True
            if len(step.seqs) == 1:
                step.selected[step.seqs[0]] = [keys]
            else:
                of = np.repeat(owner, sizes)
                for i, seq in enumerate(step.seqs):
                    mine = keys[of == i]
                    if len(mine):
                        step.selected[seq] = [mine]
        for i, seq in enumerate(step.seqs):
            nb = r.blocks.table(seq).num_blocks
            where = self.host_locs[~selecting[i], i, :nb]  # [layers, nb]: nothing moved during the step
            r.tiers.count_reads(seq, where.size, int((where < 0).sum()))


class _Rewrite(_Step):
    """A forward that computes one block's K/V again: its tokens attend to the blocks before it
    (staged from the archive where needed) and to themselves; nothing past the block is read."""

    def __init__(self, runner: ModelRunner, chunk: Chunk, rows: np.ndarray, block: int) -> None:
        ends = torch.full((len(chunk.token_ids),), chunk.start + len(chunk.token_ids), device=runner.device)
        super().__init__(runner, [chunk], rows, ends, {})
        self.block = block
        self.write_behind = False  # its attention reads the rewritten block from the pool

    def layer(self, index: int, q: torch.Tensor, scale: float) -> LayerKV:
        r = self.runner
        seq = self.seqs[0]
        r.tiers.stage(index, self.seqs, self.protect, upto={seq: self.block + 1})
        locations = r.blocks.table(seq).locations(index)[: self.block + 1]
        return LayerKV(
            query_lens=self.query_lens,
            kv_lens=self.kv_lens,
            runs=(runs_of(locations),),
            tables=lambda: r.padded_locations([locations]),
        )


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        hbm_slots_per_layer: int | Sequence[int],
        ddr_slots: int,
        block_size: int,
        archive: Archive | None = None,
        high_watermark: float = 0.85,
        check_invariants: bool = False,
        hbf: HbfConfig | None = None,
        promote_mb_per_step: float | None = None,
        ssd_retry_interval_s: float = 10.0,
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = model.lm_head.weight_t.device
        if self.device.type == "cuda":
            model.use_attention(kernel_attention)  # decode steps through the Triton paged kernel
        hbf = hbf or replace(EngineConfig(), policy=Exact.name).hbf
        promote = None if promote_mb_per_step is None else int(promote_mb_per_step * 2**20)
        self.kv = KVCache(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=model.lm_head.weight_t.dtype,
            device=self.device,
            hbm_regions=hbm_slots_per_layer,
            ddr_slots=ddr_slots,
            block_size=block_size,
            hbf=hbf,
            archive=archive,
            high_watermark=high_watermark,
            promote_bytes_per_step=promote,
            kinds=cfg.layer_kinds,
            ssd_retry_interval_s=ssd_retry_interval_s,
        )
        # The step's view of the cache's parts (the cache owns them).
        self.blocks, self.tiers, self.digests, self.hbf = self.kv.blocks, self.kv.tiers, self.kv.digests, hbf
        self.hbm, self.ddr = self.kv.hbm, self.kv.ddr
        self.pools = Pools(k=(self.hbm.k, self.ddr.k), v=(self.hbm.v, self.ddr.v))
        self.check_invariants = check_invariants
        # Tests: the GPU's step paths on the CPU (decode planned on the device, `_DevicePlan`; K/V
        # written in one launch, `paged_write`).
        self.plan_on_device = False
        self.device_planned_steps = 0  # steps planned on the device (`_DevicePlan`), for tests
        self.graphs = DecodeGraphs(self)  # exact decode steps as CUDA graphs (tests: `.enabled` on the CPU)
        self.kv.lagged = self.graphs.take_lagged
        # Prefill's KV writes trail its compute here (CUDA; on the CPU they are written in place).
        self.transfer_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def cached_tokens(self, seq: SeqId) -> int:
        return self.kv.cached_tokens(seq)

    def can_fit(self, chunks: list[Chunk]) -> bool:
        """Whether the tiers can take the chunks' new blocks (evicting to the archive if there is one)."""
        if self.tiers.archive is not None:
            return True
        need = sum(self.blocks.blocks_needed(c.seq, len(c.token_ids)) for c in chunks)
        short = sum(max(need - a.num_free, 0) for a in self.blocks.hbm_alloc)
        return short <= self.blocks.ddr_free

    def padded_locations(self, locs: list[np.ndarray]) -> torch.Tensor:
        """Locations of the blocks each sequence reads, padded: [B, W] (0 pads: the null slot)."""
        out = np.zeros((len(locs), max(1, max(len(x) for x in locs))), dtype=np.int64)
        for i, x in enumerate(locs):
            out[i, : len(x)] = x
        return torch.from_numpy(out).to(self.device)

    def _prepare(self, chunks: list[Chunk]) -> tuple[torch.Tensor | None, torch.Tensor | None, _Step]:
        """Append the chunks' tokens to their tables; the forward's ids and positions (None for a
        step replayed as a CUDA graph, which has its own buffers) and its view of the cache."""
        seqs = [c.seq for c in chunks]
        self.tiers.begin_step(seqs)
        protect = {c.seq: c.start // self.blocks.block_size for c in chunks}
        rows, positions, seq_ends = [], [], []
        for c in chunks:
            if self.blocks.table(c.seq).num_tokens != c.start:
                raise RuntimeError(
                    f"chunk for seq {c.seq} starts at {c.start}, cache holds {self.cached_tokens(c.seq)}"
                )
            self.tiers.prepare_append(c.seq, len(c.token_ids), seqs, protect)
            rows.append(self.blocks.append(c.seq, len(c.token_ids)))  # [L, n]
            end = c.start + len(c.token_ids)
            positions.append(np.arange(c.start, end, dtype=np.int64))
            seq_ends.append(np.full(len(c.token_ids), end, dtype=np.int64))
        dev = self.device
        all_rows = np.concatenate(rows, axis=1)
        if self.graphs.applies(seqs, [len(c.token_ids) for c in chunks], all_rows):
            return None, None, _Step(self, chunks, all_rows, torch.empty(0), protect, graphed=True)
        ends = torch.from_numpy(np.concatenate(seq_ends)).to(dev)
        step = _Step(self, chunks, all_rows, ends, protect)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64, device=dev)
        return ids, torch.from_numpy(np.concatenate(positions)).to(dev), step

    @torch.inference_mode()
    def execute(self, chunks: list[Chunk], all_logits: bool = False) -> torch.Tensor:
        """Run the chunks; return fp32 logits of each chunk's last token where `want_logits`
        ([M, vocab]), or of every token when `all_logits` ([N, vocab])."""
        for c in chunks:
            self.kv.refresh_digests(c.seq)  # may meet a damaged record: done again after its rewrite
        try:
            ids, positions, step = self._prepare(chunks)
            if step.graphed:
                hidden = self.graphs.run(step, [c.token_ids[0] for c in chunks])
            else:
                assert ids is not None and positions is not None
                hidden = self.model(ids, positions, step)  # [N, hidden]
        except BaseException:
            # A step that failed midway (no room, a corrupt archive record) leaves no half-written
            # tokens behind: the cache of each sequence ends where its chunk started (after the
            # writes still in flight, which target the slots given back here).
            if self.transfer_stream is not None:
                torch.cuda.current_stream().wait_stream(self.transfer_stream)
            for c in chunks:
                if self.kv.has(c.seq):
                    self.kv.cut(c.seq, c.start)
            raise
        if step.wrote_behind and self.transfer_stream is not None:
            torch.cuda.current_stream().wait_stream(self.transfer_stream)  # the next step reads the rows
        # The logits go to the device first: the bookkeeping below waits for the step's selections
        # (on a GPU), and the device computes them meanwhile.
        if all_logits:
            out = self.model.logits(hidden)
        else:
            ends = np.cumsum([len(c.token_ids) for c in chunks]) - 1
            pick = [int(e) for e, c in zip(ends, chunks, strict=True) if c.want_logits]
            if pick:
                out = self.model.logits(hidden[pick])
            else:
                out = hidden.new_zeros((0, self.model.config.vocab_size), dtype=torch.float32)
        if step.plan is not None:
            step.plan.resolve()
        # The previous replayed step's picks, promoted now: the host plans while the device runs
        # this step (the copies queue behind it). Then this step's own (lagged to the next one).
        kv = self.kv
        kv.flush_lagged(step.protect)
        self.graphs.resolve(step)
        if step.selected:
            selected = {s: np.concatenate(keys) for s, keys in step.selected.items()}
            kv.promoter.promote(selected, step.protect, {s: kv.keep(s) for s in step.seqs})
        for seq, n in zip(step.seqs, step.query_lens, strict=True):
            if n == 1:
                state = kv.selection(seq)
                state.policy.after_step(state, self.hbf)
        kv.promoter.fill_hbm(step.seqs, step.protect)
        self.tiers.end_step(step.seqs)
        if self.check_invariants:
            kv.check()
        return out

    @torch.inference_mode()
    def rewrite(self, seq: SeqId, block: int, token_ids: list[int]) -> None:
        """Compute the K/V of `seq`'s block `block` again, in every layer, from its tokens (the
        block's archive record was damaged); the blocks after it are neither read nor changed.
        Raises `ArchiveCorrupt` if a block before it is damaged too: rewrite that one first, then
        this one again."""
        self.kv.flush_lagged()
        start = block * self.blocks.block_size
        if len(token_ids) != min(self.blocks.block_size, self.cached_tokens(seq) - start):
            raise ValueError(f"block {block} of seq {seq} holds other tokens than the {len(token_ids)} given")
        try:
            self.tiers.begin_rewrite(seq, block)
            rows = self.blocks.rewrite(seq, block)
            chunk = Chunk(seq, tuple(token_ids), start, want_logits=False)
            ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
            positions = torch.arange(start, start + len(token_ids), device=self.device)
            self.model(ids, positions, _Rewrite(self, chunk, rows, block))
        finally:
            self.tiers.end_rewrite()
        if self.check_invariants:
            self.kv.check()
