"""The tier manager: where each block lives, and the moves that keep every step's blocks readable.

Policy `exact` (lossless): every decode step reads every block of a session, layer after layer —
a cyclic pattern on which LRU evicts exactly the block needed next. So nothing is promoted: the
blocks that got HBM slots keep them (a fixed resident subset per layer), the others are read from
DDR in place, and a session larger than HBM + DDR has the blocks of each layer staged from the SSD
archive into DDR just before that layer runs, evicting the blocks whose next use is furthest away
(the layers just computed). Idle sessions are demoted first; DDR spills to the archive past
`ddr_high_watermark`. A DDR copy is dropped only once an archive copy is durable.

A failed archive write (a full disk, an I/O error) marks the SSD tier degraded: DDR copies are
kept, nothing more is written, and DDR is freed by dropping idle sessions' KV, to be computed
again from their token logs when next used (evicting by recompute). Every
`ssd_retry_interval_s` the archive is cut back to its last durable state and writes resume.

Owner: the counters, the archive keys of sessions, and every decision to move a block. The
`BlockManager` records the moves (it is the one writer of residency); the `Mover` copies bytes.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import numpy as np
import torch

from h3d.errors import NoArchive, OutOfBlocks, SsdDegraded
from h3d.kv.blocks import NONE, BlockManager, SeqId
from h3d.kv.pool import KVPool
from h3d.tiers.archive import Archive, ArchiveWriteFailed, BlockKey
from h3d.tiers.mover import Mover, Transfer
from h3d.tiers.stats import SessionCounters, TierCounters, TierStats

Pair = tuple[SeqId, int]  # (sequence, layer)
HOT_DECAY = 0.99  # per step: a use counts ~1/e after 100 steps
RESCALE_STEPS = 4096  # HOT_DECAY ** -4096 ~ 1e18: far from float32's limit even summed over 100 uses
LATENCY_WINDOW = 4096


class TierManager:
    def __init__(
        self,
        blocks: BlockManager,
        hbm: KVPool,
        ddr: KVPool,
        archive: Archive | None,
        high_watermark: float,
        promote_bytes_per_step: int | None = None,
    ) -> None:
        self.blocks = blocks
        self.hbm = hbm
        self.ddr = ddr
        self.archive = archive
        self.mover = Mover(hbm, ddr, archive)
        self.high_watermark = high_watermark
        # HBF promotions per step (all sessions), the hottest first; None: no limit (see `promote`)
        self.promote_blocks_per_step = (
            None if promote_bytes_per_step is None else max(1, promote_bytes_per_step // hbm.slot_bytes)
        )
        self.counters = TierCounters()
        self.names: dict[SeqId, str] = {}
        self._last_used: dict[SeqId, int] = {}
        self._step = 0
        self._spilling: dict[int, list[tuple[SeqId, int, np.ndarray]]] = {}  # transfer id -> blocks
        self._hotness: dict[SeqId, np.ndarray] = {}  # see _rank
        self._hot_base = 0  # the step the ranks are scaled to (see _use_weight)
        self._marks: np.ndarray | None = None  # see _union
        self._slot_ok: np.ndarray | None = None  # see _evict_cold
        self.latencies_us: list[float] = []  # host-side HBF planning per step (promote)
        self.per_session: dict[SeqId, SessionCounters] = {}
        self.pinned: set[SeqId] = set()  # never demoted from HBM while idle
        self._rewriting: tuple[SeqId, int] | None = None  # (seq, block) being computed again: never moved
        self.ssd_degraded: str | None = None  # why the archive takes no writes now
        self.ssd_retry_interval_s = 10.0
        self._ssd_retry_at = 0.0
        self.notices: list[tuple[str, dict[str, object]]] = []  # (log event, fields) for the daemon's log

    @property
    def block_bytes(self) -> int:
        return self.hbm.slot_bytes

    def register(self, seq: SeqId, name: str) -> None:
        self.names[seq] = name

    def release(self, seq: SeqId, purge_archive: bool = True) -> None:
        self._settle()
        self.blocks.free(seq)
        name = self.names.pop(seq, None)
        self._last_used.pop(seq, None)
        self._hotness.pop(seq, None)
        self.per_session.pop(seq, None)
        self.pinned.discard(seq)
        if purge_archive and name is not None and self.archive is not None:
            self.archive.delete_session(name)

    # ---- admission --------------------------------------------------------------------------

    def admit(self, seq: SeqId, n_tokens: int) -> None:
        """Refuse (OutOfBlocks) `n_tokens` more tokens of `seq` that the tiers cannot hold."""
        b = self.blocks
        table = b.table(seq)
        per_layer = b.blocks_for(table.num_tokens + n_tokens)
        if per_layer > b.slots_per_layer + b.ddr_alloc.capacity:
            raise OutOfBlocks(
                f"a session of {table.num_tokens + n_tokens} tokens needs {per_layer} blocks per layer readable at "
                f"once; HBM ({b.slots_per_layer} in its smallest layer region) and DDR ({b.ddr_alloc.capacity}) "
                "hold fewer: "
                "raise hbm_mb or ddr_mb"
            )
        if self.archive is None:
            used = sum(t.num_blocks for t in b.tables().values()) * b.num_layers
            capacity = b.hbm_capacity + b.ddr_alloc.capacity
            new = (per_layer - table.num_blocks) * b.num_layers
            if used + new > capacity:
                raise OutOfBlocks(
                    f"HBM and DDR are full ({used} of {capacity} blocks used, {new} more needed) and no "
                    "ssd_path is configured: close sessions, or configure an SSD archive"
                )

    def chunk_limit(self, seq: SeqId) -> int:
        """Most tokens of `seq` one step may write: their new blocks must fit beside the space
        needed to stage one whole layer of the session (blocks written this step cannot move)."""
        b = self.blocks
        if self.archive is None:
            return 1 << 30  # admission already checked that everything fits
        t = b.table(seq)
        room = b.ddr_alloc.capacity - t.num_blocks - len(b.tables())  # other sessions' partial blocks
        per_layer = min(a.num_free for a in b.hbm_alloc) + max(room, 0) // b.num_layers
        return max(1, per_layer * b.block_size - t.num_tokens % b.block_size)

    # ---- step hooks -------------------------------------------------------------------------

    def begin_step(self, batch: list[SeqId]) -> None:
        self._step += 1
        for seq in batch:
            self._last_used[seq] = self._step
        self._complete(self.mover.poll())
        if self.ssd_degraded is not None and time.monotonic() >= self._ssd_retry_at:
            self.retry_ssd()

    # ---- the SSD tier's health --------------------------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether blocks can be archived now (an archive, not degraded)."""
        return self.archive is not None and self.ssd_degraded is None

    def degrade(self, error: ArchiveWriteFailed) -> None:
        self.counters.ssd_write_errors += 1
        self._ssd_retry_at = time.monotonic() + self.ssd_retry_interval_s
        if self.ssd_degraded is None:
            self.ssd_degraded = str(error)
            self.notices.append(("ssd_degraded", {"reason": str(error), "retry_s": self.ssd_retry_interval_s}))

    def retry_ssd(self) -> bool:
        """Try the degraded SSD tier again: cut the archive back to its last durable state and
        take writes (the next failure degrades it again). Returns whether it is writable."""
        if self.archive is None or self.ssd_degraded is None:
            return self.archive is not None
        self._settle()
        try:
            self.archive.recover()
        except OSError as e:
            self._ssd_retry_at = time.monotonic() + self.ssd_retry_interval_s
            self.ssd_degraded = f"{self.ssd_degraded}; recovering failed: {e}"
            return False
        self.notices.append(("ssd_recovered", {"after": self.ssd_degraded}))
        self.ssd_degraded = None
        return True

    def _drop_idle_kv(self, need: int, protect: dict[SeqId, int]) -> int:
        """Free `need` DDR slots by forgetting the KV of idle sessions, least recently used
        first, from their last block back (their tokens stay; the next request computes the KV
        again). Returns the slots freed."""
        b = self.blocks
        busy = set(protect) | self.pinned | ({self._rewriting[0]} if self._rewriting else set())
        freed = 0
        for seq in sorted((s for s in b.tables() if s not in busy), key=lambda s: self._last_used.get(s, 0)):
            t = b.table(seq)
            per_block = (t.ddr[:, : t.num_blocks] != NONE).sum(axis=0)  # DDR copies of each block
            if not per_block.any():
                continue
            from_end = np.cumsum(per_block[::-1])  # slots freed by dropping the last i+1 blocks
            keep = t.num_blocks - 1 - int(np.searchsorted(from_end, need - freed))
            keep = max(keep, 0)
            got = int(per_block[keep:].sum())
            copies = int((t.hbm[:, keep : t.num_blocks] != NONE).sum()) + got
            b.truncate(seq, keep * b.block_size)
            self.counters.recompute_evict_count += copies
            self.notices.append(
                ("kv_dropped_for_recompute", {"session": self.names.get(seq, str(seq)), "from_block": keep})
            )
            freed += got
            if freed >= need:
                break
        return freed

    def prepare_append(self, seq: SeqId, n_tokens: int, batch: list[SeqId], protect: dict[SeqId, int]) -> None:
        """Make room so that `blocks.append(seq, n_tokens)` succeeds."""
        b = self.blocks
        self._stage_partial(seq, batch, protect)
        new = b.blocks_needed(seq, n_tokens)
        if new <= 0:
            return
        idle = [s for s in b.tables() if s not in batch and s not in self.pinned]
        for layer, alloc in enumerate(b.hbm_alloc):
            if new > alloc.num_free and idle:
                self._demote_idle(layer, new - alloc.num_free, idle, batch, protect)
        short = sum(max(new - a.num_free, 0) for a in b.hbm_alloc) - b.ddr_free
        if short > 0:
            self._free_ddr(short, self._order(batch, None), protect)

    def _stage_partial(self, seq: SeqId, batch: list[SeqId], protect: dict[SeqId, int]) -> None:
        """Bring `seq`'s partial last block into DDR in every layer where only the archive holds
        it (a checkpoint's record, after a restart): new tokens are written into it."""
        b = self.blocks
        t = b.table(seq)
        last = t.num_tokens // b.block_size
        if self.archive is None or t.num_tokens % b.block_size == 0:
            return
        layers = np.flatnonzero((t.hbm[:, last] == NONE) & (t.ddr[:, last] == NONE))
        if not len(layers):
            return
        if len(layers) > b.ddr_free:
            self._free_ddr(len(layers) - b.ddr_free, self._order(batch, None), protect)
        for layer in layers.tolist():
            block = np.array([last])
            slots = b.add_ddr(seq, layer, block)
            try:
                self.mover.read([BlockKey(self.names[seq], layer, last)], slots)
            except BaseException:
                b.unadd_ddr(seq, layer, block)
                raise
            b.set_archived(seq, layer, block, False)  # its DDR copy is its one home from now on
        self.counters.ssd_read_count += len(layers)
        self.per_session.setdefault(seq, SessionCounters()).ssd_read_count += len(layers)

    def stage(
        self, layer: int, batch: list[SeqId], protect: dict[SeqId, int], upto: dict[SeqId, int] | None = None
    ) -> None:
        """Make every block of `layer` of the batch's sequences readable (HBM or DDR); with
        `upto`, only each sequence's first `upto[seq]` blocks."""
        if self.archive is None:
            return  # without an archive every block is in HBM or DDR already
        b = self.blocks
        missing: list[tuple[SeqId, np.ndarray]] = []
        for seq in batch:
            t = b.table(seq)
            nb = t.num_blocks if upto is None else min(t.num_blocks, upto[seq])
            gone = np.flatnonzero((t.hbm[layer, :nb] == NONE) & (t.ddr[layer, :nb] == NONE))
            if len(gone):
                missing.append((seq, gone))
        staged = sum(len(g) for _, g in missing)
        if staged:
            short = staged - b.ddr_free
            if short > 0:
                order = [p for p in self._order(batch, layer) if not (p[1] == layer and p[0] in batch)]
                self._free_ddr(short, order, protect)
            for seq, gone in missing:
                slots = b.add_ddr(seq, layer, gone)
                keys = [BlockKey(self.names[seq], layer, int(j)) for j in gone]
                try:
                    self.mover.read(keys, slots)
                except BaseException:
                    b.unadd_ddr(seq, layer, gone)  # never leave a table pointing at unread bytes
                    raise
                t = b.table(seq)
                partial = gone[gone >= t.num_tokens // b.block_size]
                if len(partial):
                    # A partial block (archived at a checkpoint) is written to from now on: its
                    # DDR copy is its one home, the archived record is stale.
                    b.set_archived(seq, layer, partial, False)
            self.counters.ssd_read_count += staged
            for seq, gone in missing:
                self.per_session.setdefault(seq, SessionCounters()).ssd_read_count += len(gone)
            self.counters.ddr_hits -= staged  # count_reads will find them in DDR: they came from SSD

    def begin_rewrite(self, seq: SeqId, block: int) -> None:
        """Make room for `BlockManager.rewrite(seq, block)`: a DDR slot for every layer in which
        the block has no copy. Until `end_rewrite` that block is never moved."""
        self._rewriting = (seq, block)
        short = self.blocks.homeless(seq, block) - self.blocks.ddr_free
        if short > 0:
            self._free_ddr(short, self._order([seq], None), {})

    def end_rewrite(self) -> None:
        self._rewriting = None

    def count_reads(self, seq: SeqId, total: int, below: int, fetched: int | None = None) -> None:
        """Count the blocks a layer's attention reads for `seq`: `total`, of which `below` HBM;
        `fetched`: the bytes that crossed, when not `below` whole blocks (per-head selections)."""
        c = self.counters
        c.hbm_hits += total - below
        c.hbm_misses += below
        c.ddr_hits += below
        c.fetch_bytes += below * self.block_bytes if fetched is None else fetched
        mine = self.per_session.setdefault(seq, SessionCounters())
        mine.hbm_hits += total - below
        mine.hbm_misses += below

    def count_selected(self, seq: SeqId, keys: np.ndarray, in_hbm: np.ndarray) -> None:
        """Count a step's selection reads (`keys` as `promote` takes them, one per reading KV head)
        where they were when the step read them (`in_hbm`, per key), for a promotion made later
        (`promote(..., counted=True)`): the distinct blocks, those read from DDR, the heads' bytes."""
        size = self.blocks.num_layers * self.blocks.table(seq).capacity
        missed = keys[~in_hbm]  # a block's keys all share its residency
        fetched = len(missed) * (self.block_bytes // self.hbm.k.shape[0])
        self.count_reads(seq, len(self._union(keys, size)), len(self._union(missed, size)), fetched)

    def promote(
        self,
        selected: dict[SeqId, np.ndarray],
        protect: dict[SeqId, int],
        keep: dict[SeqId, np.ndarray],
        counted: bool = False,
    ) -> None:
        """HBF, between steps: bring the blocks just read from DDR into HBM for the next step (the
        selection is the prefetch guess), evicting the least valuable HBM blocks of each layer by
        recency + hotness; never the sinks, the recent window, blocks written this step or the
        selection itself. `selected[seq]` holds the (layer, block) pairs the step's selections
        read, as keys `layer * table.capacity + block` (`BlockTable.capacity`), in any order and repeated
        where several KV heads read a block; their reads are counted here (`count_reads`). All
        layers at once: no per-layer or per-block loop. Times the decisions (`hbf_latency_us`):
        the union of the heads' picks, the counts, the choice of victims and the table updates,
        not the copies. `counted`: the reads were counted already (`count_selected`), as the step
        that made them saw them.

        At most `promote_blocks_per_step` blocks move per step (`promote_mb_per_step`), shared
        equally by the sessions, each session's hottest first: a block read from DDR in place
        costs its heads' share of it over PCIe, a promotion the whole block, and selections that
        change from step to step would otherwise spend the link on copies read once."""
        t0 = time.perf_counter()
        copy_s = 0.0
        weight = np.float32(self._use_weight())
        limit = self.promote_blocks_per_step
        share = None if limit is None else max(1, limit // max(1, len(selected)))
        for seq, keys in selected.items():
            if len(keys):
                copy_s += self._promote_seq(seq, keys, protect, keep[seq], weight, share, counted)
        self.latencies_us.append((time.perf_counter() - t0 - copy_s) * 1e6)
        if len(self.latencies_us) > 2 * LATENCY_WINDOW:
            del self.latencies_us[:-LATENCY_WINDOW]

    def _union(self, keys: np.ndarray, size: int) -> np.ndarray:
        """The distinct keys, ascending (a mark per key in a reused [size] buffer: no sort)."""
        if self._marks is None or len(self._marks) < size:
            self._marks = np.zeros(max(size, 2 * len(self._marks) if self._marks is not None else 0), dtype=bool)
        marks = self._marks
        marks[keys] = True
        at = np.flatnonzero(marks[:size])
        marks[at] = False  # the buffer is all False again
        return at

    def _promote_seq(
        self,
        seq: SeqId,
        keys: np.ndarray,
        protect: dict[SeqId, int],
        keep: np.ndarray,
        weight: np.float32,
        limit: int | None,
        counted: bool = False,
    ) -> float:
        """Count and promote one session's selected pairs (at most `limit` moves); returns the
        seconds spent copying bytes."""
        b = self.blocks
        t = b.table(seq)
        width = t.capacity
        at = self._union(keys, b.num_layers * width)  # [n] distinct pairs, by layer then block
        rank = self._rank(seq, width).ravel()  # a view: writes land in the [L, width] array
        rank[at] += weight  # a use (see _rank); `at` is distinct: one add each
        in_hbm = t.hbm.ravel().take(at)  # [n] slot or NONE
        miss = np.flatnonzero(in_hbm < 0)
        if not counted:  # each key is one KV head's read: what crossed PCIe is its share of the block
            head_misses = int(np.count_nonzero(t.hbm.ravel().take(keys) < 0))
            self.count_reads(seq, len(at), len(miss), head_misses * (self.block_bytes // self.hbm.k.shape[0]))
        if not len(miss):
            return 0.0
        m_at = at.take(miss)
        m_layers = m_at // width
        # Only full blocks get a second copy (the partial one keeps its single home for writes),
        # and only from DDR (a block read from DDR may have been archived and dropped since).
        src = t.ddr.ravel().take(m_at)
        ok = (m_at - m_layers * width < t.num_tokens // b.block_size) & (src >= 0)
        if not ok.all():
            m_at, m_layers, src = m_at[ok], m_layers[ok], src[ok]
        if limit is not None and len(m_at) > limit:  # the hottest `limit`, kept in (layer, block) order
            hottest = np.sort(np.argpartition(-rank.take(m_at), limit - 1)[:limit])
            m_at, m_layers, src = m_at[hottest], m_layers[hottest], src[hottest]
        m_blocks = m_at - m_layers * width
        need = np.bincount(m_layers, minlength=b.num_layers)  # [L] missing per layer
        free = b.hbm_alloc.free
        short = need - free
        if not (short > 0).any():  # room for all: no eviction
            slots = b.add_hbm_many(seq, m_layers, m_blocks)
            return self._copy_up(src, slots)
        # Worth of a layer's promotion: the least rank among its missing blocks (a victim must be
        # worth less); -inf where the layer needs no victim.
        starts = np.cumsum(need) - need
        has = need > 0
        worth = np.full(b.num_layers, -np.inf, dtype=np.float32)
        worth[has] = np.nextafter(np.minimum.reduceat(rank.take(m_at), starts[has]), np.float32(-np.inf))
        worth[short <= 0] = -np.inf
        v_layers, v_blocks, v_slots, copy_s = self._evict_cold(seq, short, worth, in_hbm, protect, keep)
        self.counters.hbm_evict_count += len(v_slots)
        if len(v_slots) == len(m_layers):
            # A victim for every missing block (each layer got as many as it needs, in layer
            # order): the r-th missing block takes the r-th victim's slot.
            b.move_hbm_many(seq, v_layers, v_blocks, m_blocks, v_slots)
            return copy_s + self._copy_up(src, v_slots)
        # A layer's r-th missing block takes its r-th victim's slot, then a free slot, while any
        # is left.
        got = np.bincount(v_layers, minlength=b.num_layers)
        within = np.arange(len(m_layers)) - starts[m_layers]
        reuse = within < got[m_layers]
        fresh = ~reuse & (within < (got + free)[m_layers])
        slots = np.empty(len(m_layers), dtype=np.int64)
        if len(v_slots):
            b.move_hbm_many(seq, v_layers, v_blocks, m_blocks[reuse], v_slots)
            slots[reuse] = v_slots
        if fresh.any():
            slots[fresh] = b.add_hbm_many(seq, m_layers[fresh], m_blocks[fresh])
        placed = reuse | fresh
        return copy_s + self._copy_up(src[placed], slots[placed])

    def _copy_up(self, src: np.ndarray, slots: np.ndarray) -> float:
        """DDR slots -> HBM slots (the promoted blocks' bytes); returns the seconds it took."""
        if not len(slots):
            return 0.0
        self.counters.promote_count += len(slots)
        c0 = time.perf_counter()
        self.mover.ddr_to_hbm(src, slots)
        return time.perf_counter() - c0

    def _slot_mask(self, size: int) -> np.ndarray:
        """A reused bool buffer of `size` + 1 entries (see `_evict_cold`)."""
        if self._slot_ok is None or len(self._slot_ok) != size + 1:
            self._slot_ok = np.zeros(size + 1, dtype=bool)
        return self._slot_ok

    def _rank(self, seq: SeqId, width: int) -> np.ndarray:
        """Each block's value for HBM, [L, width]: its count of uses decayed by HOT_DECAY per step
        (recency + hotness over ~100 steps), kept scaled by HOT_DECAY ** -(now - base) so that a use
        adds one number (`_use_weight`) and the unused blocks need no update (0: never used). The
        partial last block is ranked too, but never promoted or evicted."""
        rank = self._hotness.get(seq)
        if rank is None or rank.shape[1] < width:
            grown = np.zeros((self.blocks.num_layers, width), dtype=np.float32)
            if rank is not None:
                grown[:, : rank.shape[1]] = rank
            self._hotness[seq] = rank = grown
        return rank

    def _use_weight(self) -> float:
        """What a use adds to a block's rank this step: HOT_DECAY ** -(step - base). Every
        RESCALE_STEPS the ranks are multiplied back down (float32 holds ~8,000 steps of growth)."""
        age = self._step - self._hot_base
        if age >= RESCALE_STEPS:
            shrink = np.float32(HOT_DECAY**age)
            for rank in self._hotness.values():
                rank *= shrink
            self._hot_base, age = self._step, 0
        return float(HOT_DECAY**-age)

    def _evict_cold(
        self,
        seq: SeqId,
        count: np.ndarray,
        worth: np.ndarray,
        sel_slots: np.ndarray,
        protect: dict[SeqId, int],
        keep: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """Choose up to `count[l]` of the session's HBM blocks of each layer l with the lowest value,
        only those worth at most `worth[l]` (so a selection larger than HBM does not churn it).
        Never the selection (`sel_slots`: its blocks' HBM slots, NONE where not in HBM), `keep`,
        blocks from `protect[seq]` on or the partial block; ties go to the lowest slot. Victims
        without a DDR copy get one now (as many as DDR has room for); the caller hands their slots
        over (`BlockManager.move_hbm_many`). Returns the victims' layers (sorted), blocks and HBM
        slots, and the seconds spent copying."""
        b = self.blocks
        t = b.table(seq)
        limit = min(t.num_tokens // b.block_size, protect.get(seq, t.num_blocks))
        none = np.empty(0, dtype=np.int64)
        if limit <= 0:
            return none, none, none, 0.0
        # Slot space: whether each HBM slot's block may be given up, with one spare entry at the
        # end that NONE (-1) indexes, so that lists with NONE in them mask without a filter.
        held = b.hbm_block  # block in each slot
        ok = self._slot_mask(len(held))
        np.equal(b.hbm_owner, seq, out=ok[:-1])
        ok[:-1] &= held < limit
        ok[sel_slots] = False
        ok[t.hbm[:, keep].ravel()] = False
        cand = np.flatnonzero(ok[1:-1]) + 1  # [c] slots, ascending: grouped by layer
        rank = self._hotness[seq]
        c_layers = b.hbm_layer.take(cand)
        value = rank.ravel().take(c_layers * rank.shape[1] + held.take(cand))
        # Only blocks worth less than their layer's promotion (usually few: the sort stays small);
        # within each layer the lowest values first (lexsort is stable: ties keep the lower slot),
        # at most count[l] of them.
        cheap = np.flatnonzero(value <= worth.take(c_layers))
        if not len(cheap):
            return none, none, none, 0.0
        c_layers, cand, value = c_layers.take(cheap), cand.take(cheap), value.take(cheap)
        order = np.lexsort((value, c_layers))
        c_layers, cand = c_layers.take(order), cand.take(order)
        per = np.bincount(c_layers, minlength=b.num_layers)
        take = np.flatnonzero(np.arange(len(cand)) - (np.cumsum(per) - per).take(c_layers) < count.take(c_layers))
        victims, v_layers = cand.take(take), c_layers.take(take)
        v_blocks = held.take(victims)
        copy = t.ddr.ravel().take(v_layers * t.ddr.shape[1] + v_blocks) < 0
        n_copy = np.count_nonzero(copy)
        if n_copy > b.ddr_free:
            # No DDR room for every victim's copy: evict those with one, and as many others as fit,
            # the least valuable first (layer by layer: the victims' order).
            fits = ~copy | (np.cumsum(copy) <= b.ddr_free)
            victims, v_layers, v_blocks, copy = victims[fits], v_layers[fits], v_blocks[fits], copy[fits]
            n_copy = np.count_nonzero(copy)
        copy_s = 0.0
        if n_copy:
            slots = b.add_ddr_many(seq, v_layers[copy], v_blocks[copy])
            c0 = time.perf_counter()
            self.mover.hbm_to_ddr(victims[copy], slots)
            copy_s = time.perf_counter() - c0
        return v_layers, v_blocks, victims, copy_s

    def fill_hbm(self, batch: list[SeqId], protect: dict[SeqId, int]) -> None:
        """After a step: copy the batch's full blocks that only DDR holds (staged back from the
        archive after a restart or a reopening, or demoted while their session was idle) into free
        HBM slots of their layers, within `promote_blocks_per_step`. Nothing is evicted for them,
        so `exact`'s fixed resident subset stays fixed once HBM is full; blocks written this step
        are left alone. Without this a restored session would read from DDR for good."""
        b = self.blocks
        free = b.hbm_alloc.free.copy()  # [L]
        budget = self.promote_blocks_per_step or b.hbm_capacity
        for seq in batch:
            if budget <= 0 or not free.any():
                return
            t = b.table(seq)
            full = min(t.num_tokens // b.block_size, protect.get(seq, t.num_blocks))
            if self._rewriting is not None and self._rewriting[0] == seq:
                full = min(full, self._rewriting[1])
            layers = np.flatnonzero(free > 0)
            li, blocks = np.nonzero((t.hbm[layers, :full] == NONE) & (t.ddr[layers, :full] != NONE))
            if not len(li):
                continue
            lay = layers[li]  # sorted: np.nonzero walks rows first
            within = np.arange(len(lay)) - np.searchsorted(lay, lay)  # rank within its layer
            ok = within < free[lay]
            lay, blocks = lay[ok][:budget], blocks[ok][:budget]
            src = t.ddr[lay, blocks]
            self._copy_up(src, b.add_hbm_many(seq, lay, blocks))
            free -= np.bincount(lay, minlength=b.num_layers)
            budget -= len(lay)

    def end_step(self, batch: list[SeqId]) -> None:
        """Spill DDR past the high watermark (asynchronously); track peak HBM."""
        b = self.blocks
        used_hbm = (b.hbm_capacity - int(b.hbm_alloc.free.sum())) * self.block_bytes
        self.counters.peak_hbm_bytes = max(self.counters.peak_hbm_bytes, used_hbm)
        cap = b.ddr_alloc.capacity
        excess = (cap - b.ddr_free) - int(self.high_watermark * cap)
        if excess > 0 and self.writable and not self.mover.in_flight:
            self._spill(excess, self._order(batch, None), {})

    # ---- moves ------------------------------------------------------------------------------

    def _order(self, batch: list[SeqId], layer: int | None) -> list[Pair]:
        """(sequence, layer) pairs, the best eviction candidates first: idle sessions by least recent
        use, then the batch's layers by next use, furthest first (the layers just computed)."""
        b = self.blocks
        idle = sorted((s for s in b.tables() if s not in batch), key=lambda s: self._last_used.get(s, 0))
        L = b.num_layers
        out = [(s, layer_) for s in idle for layer_ in reversed(range(L))]
        current = 0 if layer is None else layer
        out += [(s, (current - 1 - i) % L) for i in range(L) for s in batch]
        return out

    def _candidates(self, pair: Pair, protect: dict[SeqId, int]) -> tuple[np.ndarray, np.ndarray]:
        """Full, unprotected blocks of `pair` with a DDR copy: (droppable now, needing an archive write)."""
        seq, layer = pair
        t = self.blocks.table(seq)
        limit = min(t.num_tokens // self.blocks.block_size, protect.get(seq, t.num_blocks))
        ddr = t.ddr[layer, :limit] != NONE
        if self._rewriting is not None and self._rewriting[0] == seq and self._rewriting[1] < limit:
            ddr[self._rewriting[1]] = False
        spare = (t.hbm[layer, :limit] != NONE) | t.archived[layer, :limit]
        return np.flatnonzero(ddr & spare), np.flatnonzero(ddr & ~spare)

    def _free_ddr(self, need: int, order: list[Pair], protect: dict[SeqId, int]) -> None:
        """Free `need` DDR slots now: drop redundant copies first, then archive and drop."""
        self._settle()
        before = self.blocks.ddr_free
        self._spill(need, order, protect, wait=True)
        freed = self.blocks.ddr_free - before  # archive writes that failed freed nothing
        if freed < need and self.ssd_degraded is not None:
            freed += self._drop_idle_kv(need - freed, protect)
        if freed < need:
            why = " (no ssd_path is configured)" if self.archive is None else ""
            if self.ssd_degraded is not None:
                why = f" (the SSD tier is degraded: {self.ssd_degraded})"
            raise OutOfBlocks(f"DDR is full: {need - freed} more blocks are needed and none can be evicted{why}")

    def _spill(self, need: int, order: list[Pair], protect: dict[SeqId, int], wait: bool = False) -> int:
        freed = 0
        plans = [(p, *self._candidates(p, protect)) for p in order]
        for (seq, layer), cheap, _ in plans:
            take = cheap[: need - freed]
            if len(take):
                self.blocks.drop_ddr(seq, layer, take)
                self.counters.ddr_evict_count += len(take)
                freed += len(take)
            if freed >= need:
                return freed
        if not self.writable:
            return freed
        for (seq, layer), _, costly in plans:
            take = costly[: need - freed]
            if len(take):
                self._archive(seq, layer, take, wait)
                freed += len(take)
            if freed >= need:
                break
        if wait:
            self._settle()
        return freed

    def _archive(self, seq: SeqId, layer: int, idx: np.ndarray, wait: bool) -> None:
        t = self.blocks.table(seq)
        keys = [BlockKey(self.names[seq], layer, int(j)) for j in idx]
        tokens = [self.blocks.block_size] * len(idx)  # only full blocks are archived
        transfer = self.mover.submit_write(keys, self.ddr, t.ddr[layer, idx].copy(), tokens)
        self._spilling[transfer.id] = [(seq, layer, idx)]
        self.counters.ssd_write_count += len(idx)

    def _settle(self) -> None:
        """Wait for every archive write in flight and apply it."""
        self._complete(self.mover.poll(wait=True))

    def _complete(self, done: list[Transfer]) -> None:
        for transfer in done:
            blocks = self._spilling.pop(transfer.id, [])
            try:
                transfer.future.result()  # an archive error surfaces here, before any DDR copy is dropped
            except ArchiveWriteFailed as e:
                self.degrade(e)  # the blocks keep their DDR copies
                continue
            for seq, layer, idx in blocks:
                if not self.blocks.has(seq):
                    continue
                self.blocks.set_archived(seq, layer, idx)
                self.blocks.drop_ddr(seq, layer, idx)
                self.counters.ddr_evict_count += len(idx)

    def _demote_idle(
        self, layer: int, count: int, idle: list[SeqId], batch: list[SeqId], protect: dict[SeqId, int]
    ) -> None:
        """Move up to `count` HBM blocks of `layer` from idle sessions down to DDR."""
        b = self.blocks
        for seq in sorted(idle, key=lambda s: self._last_used.get(s, 0)):
            t = b.table(seq)
            idx = np.flatnonzero(t.hbm[layer, : t.num_blocks] != NONE)[:count]
            if not len(idx):
                continue
            copy = idx[t.ddr[layer, idx] == NONE]
            if len(copy) > b.ddr_free:
                order = [p for p in self._order(batch, None) if p != (seq, layer)]
                self._free_ddr(len(copy) - b.ddr_free, order, protect)
            if len(copy):
                slots = b.add_ddr(seq, layer, copy)
                self.mover.hbm_to_ddr(t.hbm[layer, copy].copy(), slots)
            b.drop_hbm(seq, layer, idx)
            self.counters.hbm_evict_count += len(idx)
            count -= len(idx)
            if count <= 0:
                return

    def read_keys(self, seq: SeqId, layer: int, first_block: int = 0) -> torch.Tensor:
        """The written keys of `seq`'s `layer` from block `first_block` on, from HBM, DDR or the
        archive: [Hkv, tokens, D]."""
        b = self.blocks
        t = b.table(seq)
        parts = []
        for j in range(first_block, t.num_blocks):
            if t.hbm[layer, j] != NONE:
                k = self.hbm.k[:, int(t.hbm[layer, j])]
            elif t.ddr[layer, j] != NONE:
                k = self.ddr.k[:, int(t.ddr[layer, j])]
            else:
                assert self.archive is not None
                k = self.archive.get(BlockKey(self.names[seq], layer, j))[0]
            parts.append(k.to(self.hbm.k.device)[:, : min(b.block_size, t.num_tokens - j * b.block_size)])
        return torch.cat(parts, dim=1)

    # ---- admin and inspection ---------------------------------------------------------------

    def residency(self, seq: SeqId) -> tuple[int, int, int]:
        """Block copies of `seq` per tier, over all layers: (HBM, DDR, archived)."""
        t = self.blocks.table(seq)
        nb = t.num_blocks
        return (
            int((t.hbm[:, :nb] != NONE).sum()),
            int((t.ddr[:, :nb] != NONE).sum()),
            int(t.archived[:, :nb].sum()),
        )

    def demote(self, seq: SeqId, to_ssd: bool) -> int:
        """Move `seq`'s blocks down now (an idle session; between steps): to DDR (HBM copies
        dropped, copied to DDR first where needed), or to the archive (every full block archived,
        then its HBM and DDR copies dropped; the partial last block goes to DDR). Returns the block
        copies moved or dropped."""
        b = self.blocks
        t = b.table(seq)
        full = t.num_tokens // b.block_size
        moved = 0
        if to_ssd:
            if self.archive is None:
                raise NoArchive("evicting to SSD needs an archive: configure ssd_path")
            moved += self.snapshot(seq)
        for layer in range(b.num_layers):
            idx = np.flatnonzero(t.hbm[layer, : t.num_blocks] != NONE)
            if to_ssd:
                idx = idx[idx >= full]  # the full ones are archived: dropped below
            copy = idx[t.ddr[layer, idx] == NONE]
            if len(copy) > b.ddr_free:
                self._free_ddr(len(copy) - b.ddr_free, [p for p in self._order([seq], None) if p[0] != seq], {})
            if len(copy):
                slots = b.add_ddr(seq, layer, copy)
                self.mover.hbm_to_ddr(t.hbm[layer, copy].copy(), slots)
            if len(idx):
                b.drop_hbm(seq, layer, idx)
                self.counters.hbm_evict_count += len(idx)
                moved += len(idx)
            if to_ssd:
                ddr = np.flatnonzero(t.ddr[layer, :full] != NONE)
                gone = np.flatnonzero(t.hbm[layer, :full] != NONE)
                if len(gone):
                    b.drop_hbm(seq, layer, gone)
                    self.counters.hbm_evict_count += len(gone)
                    moved += len(gone)
                if len(ddr):
                    b.drop_ddr(seq, layer, ddr)
                    self.counters.ddr_evict_count += len(ddr)
                    moved += len(ddr)
        return moved

    def snapshot(self, seq: SeqId, partial: bool = False) -> int:
        """Write every full block of `seq` without an archive copy to the archive, durably, from
        wherever it is (its copies stay). With `partial` (a checkpoint before shutdown) the last,
        partial block is written too, without being marked archived: it stays the block new
        tokens go to, and only a restart reads that record. Returns the blocks written."""
        if self.archive is None:
            raise NoArchive("a snapshot needs an archive: configure ssd_path")
        self._settle()
        if self.ssd_degraded is not None and not self.retry_ssd():
            raise SsdDegraded(f"the SSD tier takes no writes now: {self.ssd_degraded}")
        try:
            return self._snapshot(seq, partial)
        except ArchiveWriteFailed as e:
            self.degrade(e)
            raise SsdDegraded(f"the SSD tier takes no writes now: {e}") from e

    def _snapshot(self, seq: SeqId, partial: bool) -> int:
        b = self.blocks
        t = b.table(seq)
        full = t.num_tokens // b.block_size
        written = 0
        for layer in range(b.num_layers):
            todo = np.flatnonzero(~t.archived[layer, :full])
            for pool, slots in ((self.hbm, t.hbm), (self.ddr, t.ddr)):
                here = todo[slots[layer, todo] != NONE]
                if len(here):
                    keys = [BlockKey(self.names[seq], layer, int(j)) for j in here]
                    self.mover.write_now(keys, pool, slots[layer, here].copy(), [b.block_size] * len(here))
                    b.set_archived(seq, layer, here)
                    todo = todo[~np.isin(todo, here)]
                    written += len(here)
            if partial and full < t.num_blocks:
                pool, slot = (
                    (self.hbm, t.hbm[layer, full]) if t.hbm[layer, full] != NONE else (self.ddr, t.ddr[layer, full])
                )
                key = BlockKey(self.names[seq], layer, full)
                self.mover.write_now([key], pool, np.array([slot]), [t.num_tokens - full * b.block_size])
                written += 1
        self.counters.ssd_write_count += written
        return written

    def park(self, seq: SeqId) -> int:
        """A closed session: every block, the partial last one included, durable in the archive,
        then every HBM and DDR copy dropped (the state a restart leaves: the next step that uses
        it stages its blocks back). Returns the blocks written."""
        written = self.snapshot(seq, partial=True)
        b = self.blocks
        t = b.table(seq)
        if t.num_tokens % b.block_size:
            for layer in range(b.num_layers):  # its record is current: it is the partial block's only copy now
                b.set_archived(seq, layer, np.array([t.num_blocks - 1]))
        b.drop_to_archive(seq)
        self.pinned.discard(seq)
        return written

    def forget(self, seq: SeqId) -> int:
        """Forget all of `seq`'s KV (its archived records too): computed again from its tokens
        when it is used next. Returns the block copies dropped."""
        b = self.blocks
        t = b.table(seq)
        nb = t.num_blocks
        copies = int((t.hbm[:, :nb] != NONE).sum() + (t.ddr[:, :nb] != NONE).sum())
        b.truncate(seq, 0)
        if self.writable and seq in self.names:
            assert self.archive is not None
            self.archive.delete_session(self.names[seq])
        self.counters.recompute_evict_count += copies
        return copies

    def adopt(self, seq: SeqId, num_tokens: int) -> int:
        """After a restart: give `seq` the longest prefix of its first `num_tokens` tokens whose
        blocks the archive holds in every layer (read lazily, when a step first needs them).
        Returns the tokens adopted; the rest are to be prefilled again."""
        if self.archive is None or num_tokens <= 0:
            return 0
        b = self.blocks
        have = self.archive.blocks_of(self.names[seq])
        done = 0
        for j in range(b.blocks_for(num_tokens)):
            want = min(b.block_size, num_tokens - j * b.block_size)
            if any(have.get((layer, j)) != want for layer in range(b.num_layers)):
                break
            done += want
        if done:
            b.adopt_archived(seq, done)
        return done

    def flush(self) -> None:
        """Wait for archive writes in flight (shutdown, tests)."""
        self._settle()

    def stats(self) -> TierStats:
        b, c = self.blocks, self.counters
        hbm_cap = b.hbm_capacity
        hbm_used = hbm_cap - int(b.hbm_alloc.free.sum())
        ddr_used = b.ddr_alloc.capacity - b.ddr_free
        ssd = self.archive.stats().stored_bytes if self.archive is not None else 0
        return TierStats(
            **asdict(c),
            hbm_hit_rate=c.hbm_hit_rate,
            hbm_used_bytes=hbm_used * self.block_bytes,
            hbm_capacity_bytes=hbm_cap * self.block_bytes,
            ddr_used_bytes=ddr_used * self.block_bytes,
            ddr_capacity_bytes=b.ddr_alloc.capacity * self.block_bytes,
            ssd_used_bytes=ssd,
            ssd_degraded=self.ssd_degraded is not None,
        )

    def check(self) -> None:
        """Bookkeeping invariants, and every pair of copies of a block holding the same bytes."""
        self._settle()
        self.blocks.check_invariants()
        for seq, t in self.blocks.tables().items():
            full = t.num_tokens // self.blocks.block_size
            for layer in range(self.blocks.num_layers):
                both = np.flatnonzero((t.hbm[layer, :full] != NONE) & (t.ddr[layer, :full] != NONE))
                if len(both):
                    hk, hv = self.hbm.read(self._index(self.hbm, t.hbm[layer, both]))
                    dk, dv = self.ddr.read(self._index(self.ddr, t.ddr[layer, both]))
                    assert torch_equal(hk, dk) and torch_equal(hv, dv), f"seq {seq} layer {layer}: HBM != DDR"
                archived = np.flatnonzero(t.archived[layer, :full] & (t.ddr[layer, :full] != NONE))
                for j in archived[:4]:  # a sample: reading the archive is slow
                    assert self.archive is not None
                    ak, av = self.archive.get(BlockKey(self.names[seq], layer, int(j)))
                    dk, dv = self.ddr.read(self._index(self.ddr, t.ddr[layer, [j]]))
                    assert torch_equal(ak, dk[:, 0]) and torch_equal(av, dv[:, 0]), (
                        f"seq {seq} layer {layer}: SSD != DDR"
                    )

    @staticmethod
    def _index(pool: KVPool, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots)).to(pool.k.device)

    def close(self) -> None:
        self._settle()
        self.mover.close()


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so -0.0 vs 0.0 and NaN payloads count)."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
