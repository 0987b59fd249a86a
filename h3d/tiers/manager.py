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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING

import numpy as np
import torch

from h3d.errors import OutOfBlocks, TiersFull
from h3d.kv.blocks import NONE, BlockManager, SeqId
from h3d.kv.pool import KVPool
from h3d.tiers.backend import ColdTier
from h3d.tiers.identity import ArchiveWriteFailed, BlockKey
from h3d.tiers.mover import Mover, Transfer
from h3d.tiers.readahead import ReadAhead
from h3d.tiers.stats import TierCounters, TierStats
from h3d.tiers.writebehind import WriteBehind

if TYPE_CHECKING:
    from h3d.kv.cache import SessionKV

Pair = tuple[SeqId, int]  # (sequence, layer)


class TierManager:
    def __init__(
        self,
        blocks: BlockManager,
        hbm: KVPool,
        ddr: KVPool,
        archive: ColdTier | None,
        high_watermark: float,
        sessions: dict[SeqId, SessionKV],
        truncate: Callable[[SeqId, int], None],
        ssd_retry_interval_s: float = 10.0,
        write_behind_dirty_mb: float | None = None,
        ssd_capacity: int | None = None,
    ) -> None:
        """`sessions`: the KV cache's records (read here; their tier fields written here);
        `truncate`: the cache's cut of a session's KV (which keeps its digests exact);
        `write_behind_dirty_mb`: the dirty KV write-behind leaves unwritten (None: off,
        `h3d.tiers.writebehind`); `ssd_capacity`: the archive's live bytes write-behind stays within."""
        self.blocks = blocks
        self.hbm = hbm
        self.ddr = ddr
        self.archive = archive
        self.mover = Mover(hbm, ddr, archive)
        self.high_watermark = high_watermark
        self.sessions = sessions
        self.truncate = truncate
        self.counters = TierCounters()
        self.step = 0  # steps begun (`begin_step`): the clock of last uses and hotness
        self._spilling: dict[int, list[tuple[SeqId, int, np.ndarray]]] = {}  # transfer id -> blocks
        self._staged_step = -1  # the last step that staged blocks from the archive
        self.rewriting: tuple[SeqId, int] | None = None  # (seq, block) being computed again: never moved
        self.frozen: dict[SeqId, int] = {}  # the KV cache's: long prompts in flight (never cut for room)
        self.ssd_degraded: str | None = None  # why the archive takes no writes now
        self.ssd_retry_interval_s = ssd_retry_interval_s
        self._ssd_retry_at = 0.0
        self.notices: list[tuple[str, dict[str, object]]] = []  # (log event, fields) for the daemon's log
        self.ssd_capacity = ssd_capacity if archive is not None else None
        # Bytes the archive's folder holds beside its records, counted against `ssd_capacity` too
        # (the KV cache's digest snapshots: `KVCache.snapshot_bytes`)
        self.side_bytes: Callable[[], int] = lambda: 0
        self.behind = WriteBehind(self, write_behind_dirty_mb)
        self.ahead = ReadAhead(self)

    @property
    def block_bytes(self) -> int:
        return self.hbm.slot_bytes

    def ssd_used(self) -> int:
        """What counts against `ssd_capacity`: the archive's live records and `side_bytes`."""
        return (self.archive.live_bytes() if self.archive is not None else 0) + self.side_bytes()

    def release(self, seq: SeqId, purge_archive: bool = True) -> None:
        """Give back `seq`'s slots, and delete its archived records with `purge_archive` (the KV
        cache forgets the rest of it). Its write-behind batches in flight are waited for, unless
        its records go: then they are abandoned (`WriteBehind.abandon`), not waited for."""
        self.settle_spills()
        if purge_archive and self.archive is not None and self.writable:
            self.behind.abandon(seq, self.sessions[seq].name)
        else:
            self.behind.forget(seq)  # waited for: their blocks stay archived
        self.ahead.drop(seq)
        self.behind.look_again(self.blocks.peers(seq))  # what it shared may be theirs alone now
        self._hand_over(seq)
        self.blocks.free(seq)
        if purge_archive and self.archive is not None:
            self.archive.remove(self.sessions[seq].name)

    def _hand_over(self, seq: SeqId) -> None:
        """The records of blocks `seq` is home to and other sessions keep, linked to one of them
        (`ColdTier.link`: no KV written), which becomes their home: they stay archived once
        `seq`'s records go. Without a writable archive they lose it (written again if needed)."""
        b, e = self.blocks, self.blocks.entries
        if self.archive is None or not self.writable or not b.peers(seq):
            return
        t = b.table(seq)
        ids = t.ids[:, : t.num_blocks]
        left = e.archived[ids] & (e.home[ids] == seq) & (e.refs[ids] > 1)
        for peer in sorted(b.peers(seq)):
            if not left.any():
                return
            other = b.table(peer)
            n = min(other.num_blocks, t.num_blocks)
            here = left[:, :n] & (other.ids[:, :n] == ids[:, :n])
            if not here.any():
                continue
            layers, blocks = np.nonzero(here)
            pairs = list(zip(layers.tolist(), blocks.tolist(), strict=True))
            try:
                self.archive.link(self.sessions[peer].name, self.sessions[seq].name, pairs)
            except ArchiveWriteFailed as err:
                self.degrade(err)
                return
            b.set_archived_many(peer, layers, blocks)  # (its home is `peer` now)
            left[:, :n] &= ~here

    # ---- admission --------------------------------------------------------------------------

    def admit(self, seq: SeqId, n_tokens: int) -> None:
        """Refuse (OutOfBlocks) `n_tokens` more tokens of `seq` that the tiers cannot hold."""
        b = self.blocks
        table = b.table(seq)
        per_layer = b.blocks_for(table.num_tokens + n_tokens)
        if per_layer > b.slots_per_layer + b.ddr_alloc.capacity:
            self.grow_ddr(per_layer - b.slots_per_layer)
        if per_layer > b.slots_per_layer + b.ddr_alloc.capacity:
            raise OutOfBlocks(
                f"a session of {table.num_tokens + n_tokens} tokens needs {per_layer} blocks per layer readable at "
                f"once; HBM ({b.slots_per_layer} in its smallest layer region) and DDR ({b.ddr_alloc.capacity}) "
                "hold fewer: "
                "raise hbm_mb or ddr_mb"
            )
        if self.archive is None:
            used = b.entries.num_used  # (a block several sessions share counts once)
            capacity = b.hbm_capacity + b.ddr_alloc.capacity
            new = (per_layer - table.num_blocks) * b.num_layers
            if used + new > capacity:
                self.grow_ddr(used + new - b.hbm_capacity)
                capacity = b.hbm_capacity + b.ddr_alloc.capacity
            if used + new > capacity:
                raise OutOfBlocks(
                    f"HBM and DDR are full ({used} of {capacity} blocks used, {new} more needed) and no "
                    "ssd_path is configured: close sessions, or configure an SSD archive"
                )
        elif self.ssd_capacity is not None:
            self._admit_archived(per_layer - table.num_blocks, self.ssd_capacity)

    def _admit_archived(self, new_blocks: int, ssd_capacity: int) -> None:
        """With an archive, the blocks of every session, once each, must fit HBM, DDR below its high
        watermark (all of it, pinned or not yet: what spills leave it holding) and the archive
        within `ssd_capacity` less `side_bytes` (a record counted at a block's raw size: the codec
        may not shrink it), else TiersFull: past that, the spills that make room in DDR would fill
        the disk, or steps would read from the archive what DDR cannot keep."""
        b = self.blocks
        new = new_blocks * b.num_layers
        used = b.entries.num_used  # (a block several sessions share counts once)
        ddr = int(self.high_watermark * b.ddr_alloc.size)
        archive = max(0, ssd_capacity - self.side_bytes()) // self.block_bytes
        capacity = b.hbm_capacity + ddr + archive
        if new > 0 and used + new > capacity:
            gib = self.block_bytes / 2**30
            raise TiersFull(
                f"the tiers cannot hold {new * gib:.2f} GiB more KV: the sessions hold {used * gib:.2f} GiB of the "
                f"{capacity * gib:.2f} GiB that HBM ({b.hbm_capacity * gib:.2f}), DDR ({ddr * gib:.2f}: below "
                f"ddr_high_watermark) and the archive ({archive * gib:.2f}: ssd_capacity_mb less the digest "
                "snapshots) hold together: close or purge sessions, or raise ssd_capacity_mb, ddr_mb or hbm_mb"
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
        self.step += 1
        for seq in batch:
            self.sessions[seq].last_used = self.step
        self._complete(self.mover.poll())
        self.behind.poll()
        self.ahead.poll()
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
        self.settle()
        try:
            self.archive.recover()
        except OSError as e:
            self._ssd_retry_at = time.monotonic() + self.ssd_retry_interval_s
            self.ssd_degraded = f"{self.ssd_degraded}; recovering failed: {e}"
            return False
        self.notices.append(("ssd_recovered", {"after": self.ssd_degraded}))
        self.ssd_degraded = None
        return True

    def _busy(self, protect: dict[SeqId, int], spare: Iterable[SeqId]) -> set[SeqId]:
        """The sessions whose KV is never cut to make room: those protected, `spare` (the ones
        the caller is working on), pinned, being rewritten, or with a long prompt in flight."""
        rewriting = {self.rewriting[0]} if self.rewriting else set()
        return set(protect) | set(spare) | self._pinned() | rewriting | set(self.frozen)

    def _drop_idle_kv(self, need: int, protect: dict[SeqId, int], spare: Iterable[SeqId] = ()) -> int:
        """Free `need` DDR slots by forgetting the KV of idle sessions, least recently used
        first, from their last block back (their tokens stay; the next request computes the KV
        again). Returns the slots freed."""
        b = self.blocks
        busy = self._busy(protect, spare)
        freed = 0
        for seq in sorted((s for s in b.tables() if s not in busy), key=lambda s: self.sessions[s].last_used):
            t = b.table(seq)
            ids = t.ids[:, : t.num_blocks]
            # DDR copies of each block that the cut frees (a block shared with others keeps its copies)
            per_block = ((b.entries.ddr[ids] != NONE) & ~b.shared(ids)).sum(axis=0)
            if not per_block.any():
                continue
            from_end = np.cumsum(per_block[::-1])  # slots freed by dropping the last i+1 blocks
            keep = t.num_blocks - 1 - int(np.searchsorted(from_end, need - freed))
            keep = max(keep, 0)
            got = int(per_block[keep:].sum())
            self._forget_from(seq, keep)
            freed += got
            if freed >= need:
                break
        return freed

    def prepare_append(self, seq: SeqId, n_tokens: int, batch: list[SeqId], protect: dict[SeqId, int]) -> None:
        """Make room so that `blocks.append(seq, n_tokens)` succeeds."""
        b = self.blocks
        self.stage_partial(seq, batch, protect)
        new = b.blocks_needed(seq, n_tokens)
        if new <= 0:
            return
        idle = [s for s in b.tables() if s not in batch and not self.sessions[s].pinned]
        for layer, alloc in enumerate(b.hbm_alloc):
            if new > alloc.num_free and idle:
                self._demote_idle(layer, new - alloc.num_free, idle, batch, protect)
        short = sum(max(new - a.num_free, 0) for a in b.hbm_alloc) - b.ddr_free
        if short > 0:
            self.free_ddr(short, self.eviction_order(batch, None), protect, [seq, *batch])

    def stage_partial(self, seq: SeqId, batch: list[SeqId], protect: dict[SeqId, int]) -> None:
        """Bring `seq`'s partial last block into DDR in every layer where only the archive holds
        it (a checkpoint's record, after a restart): new tokens are written into it."""
        b = self.blocks
        t = b.table(seq)
        last = t.num_tokens // b.block_size
        if self.archive is None or t.num_tokens % b.block_size == 0:
            return
        if not b.entries.num_archived:
            return
        ids = t.ids[:, last]
        layers = np.flatnonzero((b.entries.hbm[ids] == NONE) & (b.entries.ddr[ids] == NONE))
        if not len(layers):
            return
        if len(layers) > b.ddr_free:
            self.free_ddr(len(layers) - b.ddr_free, self.eviction_order(batch, None), protect, [seq, *batch])
        for layer in layers.tolist():
            block = np.array([last])
            slots = b.add_ddr(seq, layer, block)
            try:
                self.mover.read([BlockKey(self.sessions[seq].name, layer, last)], slots)
            except BaseException:
                b.unadd_ddr(seq, layer, block)
                raise
            b.set_archived(seq, layer, block, False)  # its DDR copy is its one home from now on
        b.entries.staged_at[t.ids[layers, last]] = self.step  # its reads this step are SSD reads
        self._staged_step = self.step
        self.counters.ssd_read_count += len(layers)
        self.sessions[seq].counters.ssd_read_count += len(layers)

    def stage(
        self,
        layer: int,
        batch: list[SeqId],
        protect: dict[SeqId, int],
        upto: dict[SeqId, int] | None = None,
        only: dict[SeqId, np.ndarray] | None = None,
    ) -> None:
        """Make every block of `layer` of the batch's sequences readable (HBM or DDR); with
        `upto`, only each sequence's first `upto[seq]` blocks; with `only`, of the sequences it
        names only those blocks (sorted, unique: what a selection reads)."""
        if self.archive is None:
            return  # without an archive every block is in HBM or DDR already
        b = self.blocks

        def archived(seq: SeqId) -> np.ndarray:
            """The blocks of `seq` this layer reads that only the archive holds (or a piece in flight)."""
            t = b.table(seq)
            nb = t.num_blocks if upto is None else min(t.num_blocks, upto[seq])
            pick = None if only is None else only.get(seq)
            if pick is None:
                return np.flatnonzero(t.archive_only(layer, nb))
            pick = pick[pick < nb]
            return pick[t.archive_only(layer, nb)[pick]]

        wanted = [(seq, archived(seq)) for seq in batch]
        if self.ahead.pieces and any(len(g) for _, g in wanted):
            # other sessions' pieces not started go after this step's reads; its own pieces in
            # flight that hold these blocks are waited for
            self.ahead.yield_to(batch)
            for seq, gone in wanted:
                if len(gone):
                    self.ahead.wait_for(seq, layer, gone)
            wanted = [(seq, archived(seq)) for seq, _ in wanted]
        missing = [(seq, gone) for seq, gone in wanted if len(gone)]
        staged = sum(len(g) for _, g in missing)
        if staged:
            short = staged - b.ddr_free
            if short > 0:
                order = [p for p in self.eviction_order(batch, layer) if not (p[1] == layer and p[0] in batch)]
                self.free_ddr(short, order, protect, batch)
                # Freeing DDR lands the spills in flight, and a spill begun before this step (its
                # blocks not protected then) leaves this layer's blocks of the batch in the
                # archive only: what to read is counted again, and room made for the rest.
                missing = [(seq, gone) for seq in batch if len(gone := archived(seq))]
                staged = sum(len(g) for _, g in missing)
                if staged > b.ddr_free:
                    self.free_ddr(staged - b.ddr_free, order, protect, batch)
            for seq, gone in missing:
                slots = b.add_ddr(seq, layer, gone)
                b.entries.staged_at[b.table(seq).ids[layer, gone]] = self.step
                keys = [BlockKey(self.sessions[seq].name, layer, int(j)) for j in gone]
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
                self.sessions[seq].counters.ssd_read_count += len(gone)
            self._staged_step = self.step  # their reads this step count as SSD reads (`staged_reads`)

    def _pinned(self) -> set[SeqId]:
        return {seq for seq, record in self.sessions.items() if record.pinned}

    def begin_rewrite(self, seq: SeqId, block: int) -> None:
        """Make room for `BlockManager.rewrite(seq, block)`: a DDR slot for every layer in which
        the block has no copy. Until `end_rewrite` that block is never moved."""
        self.rewriting = (seq, block)
        short = self.blocks.homeless(seq, block) - self.blocks.ddr_free
        if short > 0:
            self.free_ddr(short, self.eviction_order([seq], None), {}, [seq])

    def end_rewrite(self) -> None:
        self.rewriting = None

    def staged_reads(self, ids: np.ndarray) -> int:
        """How many of the blocks (entry ids) read this step were staged from the archive during
        it: their reads are SSD reads, not DDR hits."""
        if self._staged_step != self.step:
            return 0
        return int(np.count_nonzero(self.blocks.entries.staged_at.take(ids) == self.step))

    def count_reads(self, seq: SeqId, total: int, below: int, fetched: int | None = None, staged: int = 0) -> None:
        """Count the blocks a layer's attention reads for `seq`: `total`, of which `below` HBM,
        of which `staged` came from the archive this step (`staged_reads`); `fetched`: the bytes
        that crossed, when not `below` whole blocks (per-head selections)."""
        c = self.counters
        c.hbm_hits += total - below
        c.hbm_misses += below
        c.ddr_hits += below - staged
        c.fetch_bytes += below * self.block_bytes if fetched is None else fetched
        mine = self.sessions[seq].counters
        mine.hbm_hits += total - below
        mine.hbm_misses += below

    def grow_ddr(self, wait_for: int = 0) -> None:
        """Hand out the DDR slots registered since the last call (a large pinned pool is
        registered in the background after the start: `h3d.kv.pool.Pinning`); with `wait_for`,
        first wait until that many are (a request that needs them)."""
        a, pinning = self.blocks.ddr_alloc, self.ddr.pinning
        if pinning is None or a.capacity == a.size:
            return
        if wait_for > a.capacity:
            pinning.wait(min(wait_for, a.size) + 1)  # + the null slot
        a.grow(pinning.usable - 1)

    def end_step(self, batch: list[SeqId], protect: dict[SeqId, int] | None = None) -> None:
        """Spill DDR past the high watermark (asynchronously), never `protect`'s blocks; write
        dirty blocks behind (`WriteBehind.pump`); track peak HBM."""
        b = self.blocks
        self.grow_ddr()
        used_hbm = (b.hbm_capacity - int(b.hbm_alloc.free.sum())) * self.block_bytes
        self.counters.peak_hbm_bytes = max(self.counters.peak_hbm_bytes, used_hbm)
        cap = b.ddr_alloc.capacity
        excess = (cap - b.ddr_free) - int(self.high_watermark * cap)
        if excess > 0 and self.writable and not self.mover.in_flight:
            self._spill(excess, self.eviction_order(batch, None), protect or {})
        if self.behind.enabled:
            self.behind.pump(batch, protect or {}, busy=True)
        if self.ahead.queue:
            self.ahead.pump(busy=True)

    # ---- moves ------------------------------------------------------------------------------

    def eviction_order(self, batch: list[SeqId], layer: int | None) -> list[Pair]:
        """(sequence, layer) pairs, the best eviction candidates first: idle sessions by least recent
        use, then the batch's layers by next use, furthest first (the layers just computed)."""
        b = self.blocks
        idle = sorted((s for s in b.tables() if s not in batch), key=lambda s: self.sessions[s].last_used)
        L = b.num_layers
        out = [(s, layer_) for s in idle for layer_ in reversed(range(L))]
        current = 0 if layer is None else layer
        out += [(s, (current - 1 - i) % L) for i in range(L) for s in batch]
        return out

    def _candidates(self, pair: Pair, protect: dict[SeqId, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Full, unprotected blocks of `pair` with a DDR copy: (beside an HBM copy, archived and
        not in HBM: both droppable now; needing an archive write)."""
        seq, layer = pair
        t = self.blocks.table(seq)
        limit = min(t.num_tokens // self.blocks.block_size, protect.get(seq, t.num_blocks))
        ids = t.ids[layer, :limit]
        e = self.blocks.entries
        # A shared block stays put; only its DDR copy beside an HBM one may go (a cheap drop).
        ddr = (e.ddr[ids] != NONE) & (~self.blocks.shared(ids) | (e.hbm[ids] != NONE))
        if self.rewriting is not None and self.rewriting[0] == seq and self.rewriting[1] < limit:
            ddr[self.rewriting[1]] = False
        in_hbm = t.layer_hbm(layer)[:limit] != NONE
        archived = ddr & ~in_hbm & t.layer_archived(layer)[:limit]
        return np.flatnonzero(ddr & in_hbm), np.flatnonzero(archived), np.flatnonzero(ddr & ~in_hbm & ~archived)

    def free_ddr(self, need: int, order: list[Pair], protect: dict[SeqId, int], spare: Iterable[SeqId] = ()) -> None:
        """Free `need` DDR slots now: drop redundant copies first, then archive and drop (write-behind
        in flight is waited for only where that is not enough: its blocks keep their DDR copies
        until durable, then they are copies to drop). Where blocks several sessions share hold the
        rest, idle sessions that share them forget that KV (`_unshare_idle`); `spare`: sessions the
        caller is working on, never cut."""
        self.settle_spills()
        before = self.blocks.ddr_free
        self._spill(need, order, protect, wait=True)
        freed = self.blocks.ddr_free - before  # archive writes that failed freed nothing
        if freed < need and self.behind.batches:  # (a slow disk: DDR full of blocks being written behind)
            self.behind.poll(wait=True)
            self._spill(need - freed, order, protect, wait=True)
            freed = self.blocks.ddr_free - before
        if freed < need and self.ssd_degraded is None:
            for _ in self._unshare_idle(protect, spare):
                freed = self.blocks.ddr_free - before  # (a block's last reference frees its slots)
                if freed < need:
                    self._spill(need - freed, order, protect, wait=True)
                    freed = self.blocks.ddr_free - before
                if freed >= need:
                    break
        if freed < need and self.ssd_degraded is not None:
            freed += self._drop_idle_kv(need - freed, protect, spare)
        if freed < need:
            why = " (no ssd_path is configured)" if self.archive is None else ""
            if self.ssd_degraded is not None:
                why = f" (the SSD tier is degraded: {self.ssd_degraded})"
            raise OutOfBlocks(f"DDR is full: {need - freed} more blocks are needed and none can be evicted{why}")

    def _forget_from(self, seq: SeqId, block: int) -> None:
        """An idle session forgets its KV from `block` on to make room (its tokens stay: its next
        request computes the KV again); counted and logged."""
        b, e = self.blocks, self.blocks.entries
        ids = b.table(seq).ids[:, block : b.table(seq).num_blocks]
        gone = ~b.shared(ids)  # (a block others share keeps its copies)
        copies = ((e.hbm[ids] != NONE) & gone).sum() + ((e.ddr[ids] != NONE) & gone).sum()
        self.counters.recompute_evict_count += int(copies)
        self.truncate(seq, block * b.block_size)
        self.notices.append(("kv_dropped_for_recompute", {"session": self.sessions[seq].name, "from_block": block}))

    def _unshare_idle(self, protect: dict[SeqId, int], spare: Iterable[SeqId]) -> Iterator[SeqId]:
        """DDR is full and blocks shared by several sessions hold part of it (a shared block stays
        where it is): the idle sessions that share blocks in DDR forget their KV from the first
        such block on, least recently used first, one per iteration, while any is left (their
        tokens stay: the next request computes the KV again). Yields each session cut."""
        b = self.blocks
        busy = self._busy(protect, spare)
        for seq in sorted((s for s in b.tables() if s not in busy), key=lambda s: self.sessions[s].last_used):
            if not b.has(seq):
                continue
            t = b.table(seq)
            ids = t.ids[:, : t.num_blocks]
            held = (b.entries.ddr[ids] != NONE) & b.shared(ids)  # [L, n]
            if not held.any():
                continue
            self._forget_from(seq, int(np.argmax(held.any(axis=0))))
            yield seq

    def drop_cheap(self, need: int, order: list[Pair], protect: dict[SeqId, int]) -> int:
        """Drop up to `need` DDR copies of blocks with another copy (in HBM, or durable in the
        archive), in `order`; returns how many."""
        return self._drop_cheap(need, order, protect, [])

    def _drop_cheap(self, need: int, order: list[Pair], protect: dict[SeqId, int], plans: list) -> int:
        """`drop_cheap`, recording in `plans` each pair it reached with its costly blocks (those
        only DDR holds). First the copies beside an HBM copy, in every pair of `order`: the block
        is still read from HBM (if it leaves HBM later, it is copied down again); only then copies
        of archived blocks, whose next read stages them back from the archive. With HBM and DDR
        nearly full, taking both kinds in one pass left DDR full of copies of HBM blocks while
        blocks a step reads went to the archive only, to be staged back (and dropped again) at
        every step."""
        freed = 0
        reached: list[tuple[Pair, np.ndarray, np.ndarray]] = []
        for pair in order:
            beside, archived, costly = self._candidates(pair, protect)
            reached.append((pair, archived, costly))
            freed += self._drop_copies(pair, beside[: need - freed])
            if freed >= need:
                break
        for pair, archived, _ in reached:
            if freed >= need:
                break
            freed += self._drop_copies(pair, archived[: need - freed])
        plans.extend((pair, costly) for pair, _, costly in reached)
        return freed

    def _drop_copies(self, pair: Pair, idx: np.ndarray) -> int:
        if len(idx):
            self.blocks.drop_ddr(pair[0], pair[1], idx)
            self.counters.ddr_evict_count += len(idx)
        return len(idx)

    def _spill(self, need: int, order: list[Pair], protect: dict[SeqId, int], wait: bool = False) -> int:
        plans: list[tuple[Pair, np.ndarray]] = []  # the pairs the first pass reached, with their costly blocks
        freed = self._drop_cheap(need, order, protect, plans)
        if freed >= need or not self.writable:
            return freed
        for (seq, layer), costly in plans:
            take = costly[: need - freed]
            if len(take):
                self._archive(seq, layer, take, wait)
                freed += len(take)
            if freed >= need:
                break
        if wait:
            self.settle_spills()
        return freed

    def _archive(self, seq: SeqId, layer: int, idx: np.ndarray, wait: bool) -> None:
        t = self.blocks.table(seq)
        keys = [BlockKey(self.sessions[seq].name, layer, int(j)) for j in idx]
        tokens = [self.blocks.block_size] * len(idx)  # only full blocks are archived
        transfer = self.mover.submit_write(keys, self.ddr, t.layer_ddr(layer)[idx].copy(), tokens)
        self._spilling[transfer.id] = [(seq, layer, idx)]
        self.counters.ssd_write_count += len(idx)

    def settle(self) -> None:
        """Wait for every archive write in flight (spills and write-behind) and apply it."""
        self._complete(self.mover.poll(wait=True))
        self.behind.poll(wait=True)

    def settle_spills(self) -> None:
        """Wait for the spills' archive writes in flight and apply them, and apply the write-behind
        batches that are done (without waiting for the others)."""
        self._complete(self.mover.poll(wait=True))
        self.behind.poll()

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
        for seq in sorted(idle, key=lambda s: self.sessions[s].last_used):
            t = b.table(seq)
            ids = t.ids[layer, : t.num_blocks]
            idx = np.flatnonzero((b.entries.hbm[ids] != NONE) & ~b.shared(ids))[:count]  # a shared block stays put
            if not len(idx):
                continue
            count -= self.demote_blocks(seq, layer, idx, batch, protect)
            if count <= 0:
                return

    def demote_blocks(
        self, seq: SeqId, layer: int, idx: np.ndarray, batch: list[SeqId], protect: dict[SeqId, int]
    ) -> int:
        """`seq`'s HBM blocks `idx` of `layer` down to DDR (a DDR copy made where there is none,
        DDR freed for it if need be); how many went (none if DDR cannot take their copies)."""
        b = self.blocks
        t = b.table(seq)
        copy = idx[t.layer_ddr(layer)[idx] == NONE]
        if len(copy) > b.ddr_free:
            order = [p for p in self.eviction_order(batch, None) if p != (seq, layer)]
            try:
                self.free_ddr(len(copy) - b.ddr_free, order, protect, [seq, *batch])
            except OutOfBlocks:
                return 0
        if len(copy):
            slots = b.add_ddr(seq, layer, copy)
            self.mover.hbm_to_ddr(t.layer_hbm(layer)[copy].copy(), slots)
        b.drop_hbm(seq, layer, idx)
        self.counters.hbm_evict_count += len(idx)
        return len(idx)

    def read_keys(self, seq: SeqId, layer: int, first_block: int = 0) -> torch.Tensor:
        """The written keys of `seq`'s `layer` from block `first_block` on, from HBM, DDR or the
        archive, on the HBM pool's device: [Hkv, tokens, D]."""
        b = self.blocks
        t = b.table(seq)
        hbm, ddr = t.layer_hbm(layer)[first_block:], t.layer_ddr(layer)[first_block:]
        pool = self.hbm.k
        out = torch.empty((pool.shape[0], len(hbm), b.block_size, pool.shape[-1]), dtype=pool.dtype, device=pool.device)
        here = np.flatnonzero(hbm != NONE)
        if len(here):
            out[:, torch.from_numpy(here).to(pool.device)] = pool[:, torch.from_numpy(hbm[here]).to(pool.device)]
        there = np.flatnonzero((hbm == NONE) & (ddr != NONE))
        if len(there):
            k = self.ddr.k[:, torch.from_numpy(ddr[there])]
            out[:, torch.from_numpy(there).to(pool.device)] = k.to(pool.device)
        for j in np.flatnonzero((hbm == NONE) & (ddr == NONE)).tolist():
            assert self.archive is not None
            k = self.archive.get(BlockKey(self.sessions[seq].name, layer, first_block + j))[0]
            out[:, j, : k.shape[1]] = k.to(pool.device)
        return out.flatten(1, 2)[:, : t.num_tokens - first_block * b.block_size]

    def load(self, seq: SeqId, first_block: int = 0, upto: int | None = None) -> int:
        """Stage `seq`'s blocks from `first_block` on (to `upto`) that only the archive holds into
        DDR, all layers at once (its records read on several threads: `Mover.read`), as many as
        fit below the high watermark (the others stay in the archive, staged when a step needs
        them): a session resumed after a restart or reopened, whose digests are rebuilt from them;
        the blocks a fork copies. Returns the blocks staged."""
        if self.archive is None:
            return 0
        b = self.blocks
        t = b.table(seq)
        layers, blocks = np.nonzero(t.archive_only(upto=upto))
        layers, blocks = layers[blocks >= first_block], blocks[blocks >= first_block]
        cap = b.ddr_alloc.capacity
        room = int(self.high_watermark * cap) - (cap - b.ddr_free)
        if room <= 0 or not len(blocks):
            return 0
        order = np.lexsort((layers, blocks))[:room]  # the first blocks of every layer first
        layers, blocks = layers[order], blocks[order]
        slots = b.add_ddr_many(seq, layers, blocks)
        name = self.sessions[seq].name
        try:
            self.mover.read([BlockKey(name, int(la), int(j)) for la, j in zip(layers, blocks, strict=True)], slots)
        except BaseException:
            for layer in np.unique(layers).tolist():
                b.unadd_ddr(seq, layer, blocks[layers == layer])
            raise
        last = t.num_tokens // b.block_size
        partial = blocks == last
        for layer in layers[partial].tolist():  # its DDR copy is its one home: the record is stale once written to
            b.set_archived(seq, layer, np.array([last]), False)
        self.counters.ssd_read_count += len(blocks)
        self.sessions[seq].counters.ssd_read_count += len(blocks)
        return len(blocks)

    # ---- inspection -------------------------------------------------------------------------

    def stats(self) -> TierStats:
        b, c = self.blocks, self.counters
        hbm_cap = b.hbm_capacity
        hbm_used = hbm_cap - int(b.hbm_alloc.free.sum())
        ddr_used = b.ddr_alloc.capacity - b.ddr_free
        ssd = self.ssd_used()
        behind = self.behind.stats()
        return TierStats(
            **asdict(c),
            hbm_hit_rate=c.hbm_hit_rate,
            hbm_used_bytes=hbm_used * self.block_bytes,
            hbm_capacity_bytes=hbm_cap * self.block_bytes,
            ddr_used_bytes=ddr_used * self.block_bytes,
            ddr_capacity_bytes=b.ddr_alloc.capacity * self.block_bytes,
            ssd_used_bytes=ssd,
            ssd_degraded=self.ssd_degraded is not None,
            dirty_bytes=behind.dirty_bytes,
            write_behind_bytes=behind.written_bytes,
            write_behind_in_flight_bytes=behind.in_flight_bytes,
            read_ahead_bytes=self.ahead.read_blocks * self.block_bytes,
            read_ahead_in_flight_bytes=self.ahead.in_flight * self.block_bytes,
            write_behind_lag_s=behind.lag_s,
            window_hbm_bytes=self._window_hbm() * self.block_bytes,
            copy_up_bytes=self.mover.copied["up"] * self.block_bytes,
            copy_down_bytes=self.mover.copied["down"] * self.block_bytes,
            **self._sharing(),
        )

    def _sharing(self) -> dict[str, int]:
        """The shared blocks, and the HBM and DDR their sharing saves (each session beyond the
        first would hold its own copies)."""
        e = self.blocks.entries
        if not self.blocks.sharing:  # (no scan of every entry while nothing is shared)
            return {"shared_blocks": 0, "shared_hbm_saved_bytes": 0, "shared_ddr_saved_bytes": 0}
        shared = np.flatnonzero(e.refs > 1)
        extra = e.refs[shared] - 1
        return {
            "shared_blocks": len(shared),
            "shared_hbm_saved_bytes": int(extra[e.hbm[shared] != NONE].sum()) * self.block_bytes,
            "shared_ddr_saved_bytes": int(extra[e.ddr[shared] != NONE].sum()) * self.block_bytes,
        }

    def _window_hbm(self) -> int:
        """HBM slots the sliding-window layers' blocks hold."""
        b = self.blocks
        slide = b.window_layers
        return int(b.hbm_regions[slide].sum() - b.hbm_alloc.free[slide].sum()) if len(slide) else 0

    def check(self) -> None:
        """Bookkeeping invariants, and every pair of copies of a block holding the same bytes
        (write-behind in flight not waited for: a block is marked archived only once durable)."""
        self.settle_spills()
        self.blocks.check_invariants()
        for seq, t in self.blocks.tables().items():
            full = t.num_tokens // self.blocks.block_size
            for layer in range(self.blocks.num_layers):
                hbm, ddr = t.layer_hbm(layer), t.layer_ddr(layer)
                both = np.flatnonzero((hbm[:full] != NONE) & (ddr[:full] != NONE))
                if len(both):
                    hk, hv = self.hbm.read(self._index(self.hbm, hbm[both]))
                    dk, dv = self.ddr.read(self._index(self.ddr, ddr[both]))
                    assert torch_equal(hk, dk) and torch_equal(hv, dv), f"seq {seq} layer {layer}: HBM != DDR"
                home = self.blocks.entries.home[t.ids[layer, :full]] == seq  # (a shared block: maybe not its record)
                archived = np.flatnonzero(t.layer_archived(layer)[:full] & (ddr[:full] != NONE) & home)
                for j in archived[:4]:  # a sample: reading the archive is slow
                    assert self.archive is not None
                    ak, av = self.archive.get(BlockKey(self.sessions[seq].name, layer, int(j)))
                    dk, dv = self.ddr.read(self._index(self.ddr, ddr[[j]]))
                    assert torch_equal(ak, dk[:, 0]) and torch_equal(av, dv[:, 0]), (
                        f"seq {seq} layer {layer}: SSD != DDR"
                    )

    @staticmethod
    def _index(pool: KVPool, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots)).to(pool.k.device)

    def close(self) -> None:
        self.settle()
        self.behind.close()
        self.ahead.close()
        self.mover.close()


def torch_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (so -0.0 vs 0.0 and NaN payloads count)."""
    a, b = a.cpu().contiguous(), b.cpu().contiguous()
    return a.shape == b.shape and bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))
