"""The model runner: plans a step over the tiered KV cache, runs it as one packed forward, and
commits what it read.

The KV state it reads and writes is the KV cache's (`h3d.kv.cache.KVCache`: pools, block tables,
tiers, digests, selection states). A step goes through three calls on values (`h3d.engine.step`):
`plan(chunks)` (the one planner: allocations, the path, each chunk's selection), `execute(plan)`
(the forward; `h3d.engine.stepkv` and `h3d.engine.graphs` carry the plan out and record the reads
and picks in a `StepReport`) and `commit(report)` (the reads counted, HBF's picks promoted, the
windows updated, DDR spilled). `step(chunks)` is the three in one, for callers that want logits.
A *chunk* is a run of a sequence's tokens whose K/V are not in the cache yet: a prefill chunk of
many tokens or a decode step's one token; both go through the same forward.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from h3d.config import EngineConfig
from h3d.engine.graphs import DecodeGraphs
from h3d.engine.step import Chunk, HostTimes, Path, StepPlan, StepReport
from h3d.engine.stepkv import DeviceStepKV, HostStepKV, RewriteKV
from h3d.errors import OutOfBlocks
from h3d.hbf.policy import Exact, HbfConfig
from h3d.kernels.copies import to_device
from h3d.kv.attention import Pools, kernel_attention
from h3d.kv.blocks import SeqId
from h3d.kv.cache import KVCache
from h3d.model.llama import CausalLM
from h3d.tiers.archive import Archive

__all__ = ["Chunk", "LongForward", "ModelRunner"]


@dataclass(slots=True)
class LongForward:
    """A long chunk's forward in flight (`ModelRunner.begin`): the model's pieces
    (`CausalLM.stages`), run one at a time between other steps (`h3d.engine.prefill`)."""

    report: StepReport
    step: HostStepKV
    stages: Generator[None, None, torch.Tensor]
    pieces: int = 0
    hidden: torch.Tensor | None = None  # the final hidden states, once done


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
        rebalance_mb_per_step: float | None = None,
        ssd_retry_interval_s: float = 10.0,
        write_behind_dirty_mb: float | None = None,
        ssd_capacity: int | None = None,
        window_keep_tokens: int = 0,
        ddr_memory: str = "registered",
    ) -> None:
        cfg = model.config
        self.model = model
        self.device = model.lm_head.weight_t.device
        # Each layer's sliding window (None: full attention): a decode token of such a layer reads its
        # window's blocks only, on every path (the host's, the device-planned step, the graphs).
        self.windows = cfg.windows
        if self.device.type == "cuda":
            model.use_attention(kernel_attention)  # decode steps through the Triton paged kernel
        hbf = hbf or replace(EngineConfig(), policy=Exact.name).hbf
        # The window's entropy from the first layer that selects (a sliding-window layer never does).
        full = [i for i, w in enumerate(self.windows) if w is None and i >= hbf.dense_layers]
        hbf = replace(hbf, entropy_layer=full[0] if full else None)
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
            rebalance_bytes_per_step=None if rebalance_mb_per_step is None else int(rebalance_mb_per_step * 2**20),
            windows=cfg.windows,
            window_keep_tokens=window_keep_tokens,
            ssd_retry_interval_s=ssd_retry_interval_s,
            write_behind_dirty_mb=write_behind_dirty_mb,
            ssd_capacity=ssd_capacity,
            ddr_memory=ddr_memory,
        )
        # The step's view of the cache's parts (the cache owns them).
        self.blocks, self.tiers, self.digests, self.hbf = self.kv.blocks, self.kv.tiers, self.kv.digests, hbf
        self.hbm, self.ddr = self.kv.hbm, self.kv.ddr
        self.pools = Pools(k=(self.hbm.k, self.ddr.k), v=(self.hbm.v, self.ddr.v))
        self.check_invariants = check_invariants
        # Tests: the GPU's step paths on the CPU (decode planned on the device, `Path.DEVICE`; K/V
        # written in one launch, `paged_write`).
        self.plan_on_device = False
        self.device_planned_steps = 0  # steps on `Path.DEVICE`, for tests
        self.host_times = HostTimes()  # the host-planned forwards' since `Engine.step` reset it
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
        return to_device(out, self.device)

    # ---- the step: plan -> execute -> commit --------------------------------------------------

    @torch.inference_mode()
    def plan(self, chunks: Sequence[Chunk]) -> StepPlan:
        """The one planner: the chunks' tokens appended to their tables (the tiers make room first),
        each chunk's selection and prompt probe, and the path that carries the step out: a captured
        graph where one applies, else the device where the step is a decode step with nothing to
        stage (on a GPU), else the host. A failure (no room, a damaged archive record) leaves every
        cache where its chunk starts."""
        chunks = tuple(chunks)
        kv = self.kv
        for c in chunks:
            kv.refresh_digests(c.seq)  # may meet a damaged record: done again after its rewrite
        seqs = [c.seq for c in chunks]
        # A long forward in flight (`begin`) holds its whole sequence where it is: in the batch
        # for the tiers (never idle, never demoted) and protected from its first block.
        held = seqs + [s for s in self.kv.frozen if s not in seqs]
        try:
            self.tiers.begin_step(held)
            protect = {c.seq: c.start // self.blocks.block_size for c in chunks} | self.kv.frozen
            rows = []
            for c in chunks:
                if self.blocks.table(c.seq).num_tokens != c.start:
                    raise RuntimeError(
                        f"chunk for seq {c.seq} starts at {c.start}, cache holds {self.cached_tokens(c.seq)}"
                    )
                kv.drop_behind(c.seq, c.start)  # window layers' blocks no token of the chunk reads
                self.tiers.prepare_append(c.seq, len(c.token_ids), held, protect)
                rows.append(self.blocks.append(c.seq, len(c.token_ids)))  # [L, n]
        except BaseException:
            self._undo(chunks)
            raise
        all_rows = np.concatenate(rows, axis=1)
        policies = [kv.policy(c.seq) for c in chunks]
        plan = StepPlan(
            chunks=chunks,
            rows=all_rows,
            protect=protect,
            path=Path.HOST,
            selects=tuple(len(c.token_ids) == 1 and p.selects for c, p in zip(chunks, policies, strict=True)),
            probes=tuple(
                c.final and len(c.token_ids) > 1 and p.probes_prompt for c, p in zip(chunks, policies, strict=True)
            ),
            staging=self.tiers.archive is not None and any(kv.archive_only(s) for s in seqs),
        )
        if plan.decode and not plan.staging:  # nothing moves: the device can plan it
            key = self.graphs.applies(seqs)
            if key is not None:
                plan.path, plan.graph = Path.GRAPH, key
            elif self.device.type == "cuda" or self.plan_on_device:
                plan.path, plan.locations = Path.DEVICE, self._locations(seqs)
                self.device_planned_steps += 1
        if plan.path is not Path.HOST:  # (the host path copies a layer's digests in as it selects there)
            kv.digests.settle()
        return plan

    def _locations(self, seqs: list[SeqId]) -> np.ndarray:
        """[L, B, W] every layer's block locations of the batch (0 pads)."""
        tables = [self.blocks.table(s) for s in seqs]
        locs = np.zeros((self.blocks.num_layers, len(tables), max(t.num_blocks for t in tables)), dtype=np.int64)
        for i, t in enumerate(tables):
            locs[:, i, : t.num_blocks] = t.all_locations()
        return locs

    def _undo(self, chunks: Sequence[Chunk]) -> None:
        """A step that failed midway leaves no half-written tokens behind: the cache of each sequence
        ends where its chunk started (after the writes still in flight, which target the slots
        given back here)."""
        if self.transfer_stream is not None:
            torch.cuda.current_stream().wait_stream(self.transfer_stream)
        for c in chunks:
            if self.kv.has(c.seq):
                self.kv.cut(c.seq, c.start)

    @torch.inference_mode()
    def execute(self, plan: StepPlan, all_logits: bool = False) -> StepReport:
        """Run the plan's forward; the report holds the fp32 logits of each chunk's last token where
        `want_logits` ([M, vocab]), or of every token with `all_logits` ([N, vocab]), and what the
        step read."""
        chunks = plan.chunks
        report = StepReport(plan, torch.empty(0))
        step: HostStepKV | DeviceStepKV | None = None
        try:
            if plan.path is Path.GRAPH:
                assert plan.graph is not None
                hidden = self.graphs.run(plan, [c.token_ids[0] for c in chunks], report)
            else:
                ids, positions, seq_ends = self._inputs(chunks)
                step = (DeviceStepKV if plan.path is Path.DEVICE else HostStepKV)(self, plan, report, seq_ends)
                hidden = self.model(ids, positions, step)
        except BaseException:
            self._undo(chunks)
            raise
        return self._conclude(report, step, hidden, all_logits)

    def _inputs(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward's token ids, positions and each token's sequence length after it, [N] each."""
        ends = np.concatenate([np.full(len(c.token_ids), c.start + len(c.token_ids)) for c in chunks])
        positions = np.concatenate([np.arange(c.start, c.start + len(c.token_ids)) for c in chunks])
        ids = to_device(np.fromiter((t for c in chunks for t in c.token_ids), dtype=np.int64), self.device)
        return ids, self._on_device(positions), self._on_device(ends)

    def _on_device(self, a: np.ndarray) -> torch.Tensor:
        return to_device(a.astype(np.int64), self.device)

    def _conclude(
        self, report: StepReport, step: HostStepKV | DeviceStepKV | None, hidden: torch.Tensor, all_logits: bool
    ) -> StepReport:
        """After a forward: its writes joined, the logits, the selections' reads resolved."""
        plan, chunks = report.plan, report.plan.chunks
        if step is not None and step.wrote_behind and self.transfer_stream is not None:
            torch.cuda.current_stream().wait_stream(self.transfer_stream)  # the next step reads the rows
        # The logits go to the device first: the selections' trip to the host (on a GPU) waits for
        # the step, and the device computes them meanwhile.
        if all_logits:
            report.logits = self.model.logits(hidden)
        else:
            ends = np.cumsum(plan.query_lens) - 1
            pick = [int(e) for e, c in zip(ends, chunks, strict=True) if c.want_logits]
            if len(pick) == hidden.shape[0]:
                # Every row (a decode step): no index goes to the device. Indexing with a host list
                # uploads it with a synchronous copy, which waits for the whole step; without it
                # the host runs the runner's commit (the previous step's picks promoted, this
                # one's sent back) while the device computes, and sampling waits for the logits.
                report.logits = self.model.logits(hidden)
            elif pick:
                report.logits = self.model.logits(hidden[pick])
            else:
                report.logits = hidden.new_zeros((0, self.model.config.vocab_size), dtype=torch.float32)
        if step is not None:
            step.resolve()
        # The previous replayed step's picks, promoted by this commit: the host plans while the
        # device runs this step (the copies queue behind it).
        report.earlier = self.graphs.take_pending()
        return report

    # ---- a long chunk in pieces, between other steps ------------------------------------------

    def suspendable(self, plan: StepPlan) -> bool:
        """Whether `plan` may run in pieces between other steps (`begin`): one chunk long enough
        for the layer-by-layer path, nothing to stage from the archive (staged blocks are read in
        the layer that stages them)."""
        return (
            len(plan.chunks) == 1
            and plan.path is Path.HOST
            and not plan.staging
            and self.model.is_long(len(plan.chunks[0].token_ids))
        )

    @torch.inference_mode()
    def begin(self, plan: StepPlan) -> LongForward:
        """Start a suspendable plan's forward (`advance` runs it a piece at a time). Until `finish`
        or `abandon` its sequence's blocks stay where they are (`KVCache.frozen`): the steps between the
        pieces never move, demote, spill or evict them."""
        assert self.suspendable(plan)
        report = StepReport(plan, torch.empty(0))
        ids, positions, seq_ends = self._inputs(plan.chunks)
        step = HostStepKV(self, plan, report, seq_ends)
        self.kv.frozen[plan.chunks[0].seq] = 0
        return LongForward(report, step, self.model.stages(ids, positions, step))

    def advance(self, fwd: LongForward) -> bool:
        """Run the next piece of `fwd` (queued on a GPU); whether the forward is done. A failure
        abandons it (the cache ends where its chunk started) and propagates."""
        try:
            with torch.inference_mode():
                next(fwd.stages)
        except StopIteration as done:
            fwd.hidden = done.value
        except BaseException:
            self.abandon(fwd)
            raise
        fwd.pieces += 1
        return fwd.hidden is not None

    @torch.inference_mode()
    def finish(self, fwd: LongForward) -> StepReport:
        """A done forward's report, as `execute` makes it (for `commit`)."""
        assert fwd.hidden is not None
        self.kv.frozen.pop(fwd.report.plan.chunks[0].seq, None)
        return self._conclude(fwd.report, fwd.step, fwd.hidden, False)

    def abandon(self, fwd: LongForward) -> None:
        """Drop a forward in flight (its request cancelled, its session closed, a failure): the
        cache of its sequence ends where its chunk started."""
        fwd.stages.close()
        self.kv.frozen.pop(fwd.report.plan.chunks[0].seq, None)
        self._undo(fwd.report.plan.chunks)

    def mark(self) -> torch.cuda.Event | None:
        """An event after the work queued so far on the device's stream, to wait for later (None
        on the CPU, where that work is done)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @torch.inference_mode()
    def commit(self, report: StepReport) -> None:
        """After a step: its reads counted, an earlier step's picks (lagged) and then its own
        promoted (`Promoter.promote`: they count the selections' reads), each selecting session's
        window updated, DDR-only blocks back into free HBM, DDR spilled past the watermark."""
        kv, plan = self.kv, report.plan
        kv.digests.settle()  # digests still arriving (a resumed session's: `load_later`), all in now
        for r in report.reads:
            self.tiers.count_reads(r.seq, r.total, r.below, staged=r.staged)
        if report.earlier is not None:
            kv.promote(self.graphs.picks(report.earlier), plan.protect, counted=True)
        self.graphs.resolve(report)  # a replayed step's picks: to the host now, or lagged to the next commit
        if report.picks:
            kv.promote(report.picks, plan.protect)
        for c in plan.chunks:
            if len(c.token_ids) == 1:
                state = kv.selection(c.seq)
                state.policy.after_step(state, self.hbf)
        seqs = plan.seqs
        kv.promoter.fill_hbm(seqs, plan.protect)
        self.tiers.end_step(seqs, self.kv.frozen)
        if self.check_invariants:
            kv.check()

    def step(self, chunks: Sequence[Chunk], all_logits: bool = False) -> torch.Tensor:
        """Plan, execute and commit one step; its logits (see `execute`)."""
        report = self.execute(self.plan(chunks), all_logits)
        self.commit(report)
        return report.logits

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
        if self.blocks.keepable(seq, start) != start:
            raise OutOfBlocks(f"block {block} of seq {seq} reads blocks a sliding window has freed: prefilled again")
        try:
            self.tiers.begin_rewrite(seq, block)
            rows = self.blocks.rewrite(seq, block)
            chunk = Chunk(seq, tuple(token_ids), start, want_logits=False)
            plan = StepPlan((chunk,), rows, {}, Path.HOST, (False,), (False,), staging=True)
            ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
            positions = torch.arange(start, start + len(token_ids), device=self.device)
            self.model(ids, positions, RewriteKV(self, plan, StepReport(plan, torch.empty(0)), block))
        finally:
            self.tiers.end_rewrite()
        if self.check_invariants:
            self.kv.check()
