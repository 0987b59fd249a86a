"""Write-behind: full KV blocks written to the archive in the background, so that a shutdown has
little left to flush and a restart resumes its sessions from the archive.

A block is *dirty* when it is full (`block_size` tokens) and has no durable archive copy. Past
`write_behind_dirty_mb` of dirty KV, the oldest dirty blocks are written until the dirty KV is
back within it: the least recently used sessions first, each from its first dirty block on
(0 writes every full block as soon as it is made). What stays dirty is what a shutdown flushes
(`Engine.checkpoint`), or a crash leaves to compute again from the token log. Sliding-window
layers are never written behind: their blocks are freed once the window has passed them
(`BlockManager.drop_behind`); a shutdown's checkpoint writes the live ones.

How, without blocking a step. On the engine thread, between steps (`pump`): a block with no DDR
copy gets one (copied down from HBM, one launch on the mover's stream like any demotion); the
DDR slots to be written are held (`SlotAllocator.hold`: a slot released meanwhile is not reused
until let go), and the batch goes to the write-behind threads (`WRITE_BEHIND_THREADS`), which
wait for the copies on the device (`Mover.fence`), read the slots, compress and `put` them. A
finished batch marks its blocks archived at the next `poll` (the engine thread again); the DDR
copies stay, as cheap ones (an HBM or archive copy exists: dropped first when DDR passes its
watermark). While requests run, a step submits at most `WRITE_BEHIND_STEP_MB`; at most
`WRITE_BEHIND_IN_FLIGHT_MB` is in flight. Copies down use DDR only up to `ddr_high_watermark`,
dropping cheap copies to make room.

A closed session is parked once its full blocks are archived (`KVCache.park_later`): its dirty
blocks are written first and whatever the budget (`urgent`), so that closing a long session costs
the engine thread its partial block's write, not its dirty KV's (on an H100, a request right
after a 128K session's close waited 1.8 s for the engine thread, which was parking it).

Write-behind makes way for a prompt (`hold_back`): while a request waits for its first token (a
chat's next turn is a short prefill over a long cached context), the batches not started yet wait
and no new one is submitted, so that the threads' compression, fsyncs and GIL turns stay off the
time to first token (on an H200, a 32K chat's second turn took 0.60 s with write-behind busy
archiving the first turn's KV, against 0.27 s once it had settled: docs/BENCHMARKS.md). A hold
lasts while requests keep waiting, at most `WRITE_BEHIND_HOLD_S` in a row: holds spend a budget of
hold time that unheld time earns back second for second, so that under a steady stream of new
requests write-behind still writes at least half of the time. A step that waits for a batch
releases the hold first.

With the remote tier on, each batch made durable is also offered to `copy_up` (`CopyUp`:
`h3d.remote.copyup`), its records as written and its blocks' content digests taken when it was
submitted.

What must stay true: a block is marked archived only once its `put` returned (durable); a failed
batch leaves its blocks dirty and degrades the SSD tier (`TierManager.degrade`); a session's KV
is cut (`cut`) or released only after its batches in flight are done, so that no record of a
block that is gone is taken for the block that replaces it; no batch is written past the
archive's capacity (`TierManager.ssd_capacity`: the blocks stay dirty, and `wants_room` asks the
engine's upkeep to evict closed sessions' archived KV first).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from h3d.kv.blocks import NONE, SeqId
from h3d.tiers.identity import ArchiveWriteFailed

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from h3d.tiers.codecs import Codec
    from h3d.tiers.manager import TierManager

WRITE_BEHIND_THREADS = max(1, min(4, os.cpu_count() or 1))  # each compresses its own batches
WRITE_BEHIND_BATCH_MB = 16  # one `put` (one fsync) holds at most this much KV
WRITE_BEHIND_STEP_MB = 32  # submitted per step while requests run (the copies down lengthen it)
WRITE_BEHIND_IN_FLIGHT_MB = 512  # submitted and not yet durable, at most
WRITE_BEHIND_HOLD_S = 0.5  # the longest write-behind makes way for prompts in a row (`hold_back`)
HOLD_MARGIN_S = 0.1  # a hold outlasts the last call that asked for it by this much


@dataclass(slots=True)
class _Batch:
    """Blocks of one session on their way to the archive."""

    seq: SeqId
    layers: np.ndarray
    blocks: np.ndarray
    slots: np.ndarray  # their DDR slots, held until the batch is done
    future: Future[None]
    bytes: int
    ids: np.ndarray  # their entries (a shared block is in flight for every session that points to it)
    abandoned: bool = False  # its session was purged meanwhile (`WriteBehind.abandon`)


class CopyUp(Protocol):
    """Where write-behind's records go as well, once durable (the remote store's KV)."""

    def digests(self, name: str, blocks: np.ndarray) -> list[str] | None:
        """On the engine thread, as a batch is submitted: its blocks' content digests (None: skip it)."""
        ...

    def offer(self, layers: list[int], digests: list[str], records: list[tuple[Codec, Buffer]]) -> None:
        """On a write-behind thread, once the batch is durable; never raises, never waits."""
        ...


@dataclass(frozen=True, slots=True)
class WriteBehindStats:
    dirty_bytes: int  # full blocks without a durable archive copy
    in_flight_bytes: int  # submitted, not yet durable
    written_bytes: int  # made durable by write-behind since start (KV bytes, before compression)
    lag_s: float  # how long the dirty KV has been past write_behind_dirty_mb (0: within it)


class WriteBehind:
    def __init__(self, tiers: TierManager, dirty_mb: float | None) -> None:
        """`dirty_mb`: the dirty KV left unwritten (None: write-behind off)."""
        self.tiers = tiers
        self.enabled = dirty_mb is not None and tiers.archive is not None
        block = tiers.block_bytes
        self.dirty_limit = int((dirty_mb or 0) * 2**20) // block  # one layer's blocks
        self.per_batch = max(1, (WRITE_BEHIND_BATCH_MB << 20) // block)
        self.per_step = max(1, (WRITE_BEHIND_STEP_MB << 20) // block)
        self.max_in_flight = max(1, (WRITE_BEHIND_IN_FLIGHT_MB << 20) // block)
        self.cursor: dict[SeqId, int] = {}  # blocks before it: archived or in flight in every layer
        self.batches: list[_Batch] = []
        self._writing = np.zeros(0, dtype=bool)  # [E] the entries of the batches in flight
        self.written_blocks = 0
        self.wants_room = 0  # archive bytes it was refused for want of capacity (the upkeep makes room)
        self._over_since: float | None = None
        self.pump_due = False  # dirty KV was left past the budget at the last `pump`
        self.urgent: set[SeqId] = set()  # closed sessions being parked: all their dirty blocks, first
        self._abandoned: dict[SeqId, str] = {}  # purged sessions with batches still under way: their names
        self.copy_up: CopyUp | None = None
        self._pool = (
            ThreadPoolExecutor(WRITE_BEHIND_THREADS, thread_name_prefix="h3d-write-behind") if self.enabled else None
        )
        # `hold_back`: until when batches wait (`clock()`, time.monotonic(); read by the threads),
        # the hold time left (`_credit`, seconds) as of `_at`, and how many holds began (tests).
        self.clock = time.monotonic
        self._held_until = 0.0
        self._credit = WRITE_BEHIND_HOLD_S
        self._at = 0.0
        self.holds = 0

    # ---- making way for prompts ------------------------------------------------------------

    def hold_back(self) -> None:
        """A request waits for its first token (or a session was just made for one): hold the
        batches not started yet and submit none, until `HOLD_MARGIN_S` after the last call.

        Holds draw on a budget of hold time (`_credit`, at most `WRITE_BEHIND_HOLD_S`) that held
        time spends and unheld time earns back, second for second: a hold lasts at most
        `WRITE_BEHIND_HOLD_S` in a row, and under a steady stream of prompts write-behind still
        writes at least half of the time. A new hold needs `HOLD_MARGIN_S` of budget. (The budget
        replaced a rule that let a hold begin only `2 * WRITE_BEHIND_HOLD_S` after the last one
        began, however short: a chat's next turn, a few tenths of a second after the first turn's
        first token, found the first turn's hold too recent and had write-behind beside its
        prefill.)"""
        if not self.enabled:
            return
        now = self._account()
        if now >= self._held_until:  # a new hold
            if self._credit < HOLD_MARGIN_S:
                return
            self.holds += 1
        self._held_until = now + min(HOLD_MARGIN_S, self._credit)

    def _account(self) -> float:
        """Bring the hold budget up to now (returned): the held time since `_at` spent, the rest earned."""
        now = self.clock()
        held = max(min(now, self._held_until) - self._at, 0.0)
        self._credit = max(0.0, min(WRITE_BEHIND_HOLD_S, self._credit - 2 * held + (now - self._at)))
        self._at = now
        return now

    @property
    def held(self) -> bool:
        return self.clock() < self._held_until

    def release(self) -> None:
        """End the hold in force (the engine thread is about to wait for a batch)."""
        self._account()
        self._held_until = 0.0

    def _wait_turn(self) -> None:
        """A write-behind thread, before it starts a batch: the hold in force over."""
        while (left := self._held_until - self.clock()) > 0:
            time.sleep(min(left, 0.02))

    @property
    def in_flight(self) -> int:
        """Blocks (one layer's each) submitted and not yet applied."""
        return sum(len(b.blocks) for b in self.batches)

    # ---- the engine thread, between steps --------------------------------------------------

    def pump(self, batch: list[SeqId], protect: dict[SeqId, int], busy: bool) -> int:
        """Apply the finished batches, then submit the oldest dirty blocks past the budget (at most
        `WRITE_BEHIND_STEP_MB` when `busy`: requests are running). `protect`: blocks from which on
        a sequence is still being written (a long prefill in flight). Returns the blocks submitted."""
        self.poll()
        tiers = self.tiers
        self.pump_due = False
        if not self.enabled or not tiers.writable:
            return 0
        if self.held:  # making way for a prompt: nothing new until it has its first token
            self.pump_due = True  # (call again soon: the hold is short)
            return 0
        b = tiers.blocks
        bs, L = b.block_size, len(b.full_layers)
        todo: list[tuple[bool, float, SeqId, int, int]] = []  # (not urgent, last use, seq, first block, end)
        dirty = 0.0
        urgent = 0  # blocks of the sessions being parked: written whatever the budget
        sharing = b.sharing and L > 0
        for seq, t in b.tables().items():
            full = t.num_tokens // bs
            end = min(full, protect.get(seq, full))
            start = min(self.cursor.get(seq, 0), end)
            if start < end:
                todo.append((seq not in self.urgent, tiers.sessions[seq].last_used, seq, start, end))
                if seq in self.urgent:
                    urgent += (end - start) * L
                if sharing:  # a block n sessions share counts 1/n in each: once in all (by its first layer's)
                    refs = b.entries.refs[t.ids[b.full_layers[0], start:end]]
                    dirty += L * float((1.0 / np.maximum(refs, 1)).sum())
                else:
                    dirty += (end - start) * L
        past = int(np.ceil(dirty)) - self.dirty_limit
        if past <= 0:
            self._over_since = None
        elif self._over_since is None:
            self._over_since = time.monotonic()
        over = max(past, urgent)
        if over <= 0:
            return 0
        room = min(over, self.max_in_flight - self.in_flight, self.per_step if busy else self.max_in_flight)
        sent = 0
        used = tiers.ssd_used() if tiers.ssd_capacity is not None else None  # (once: it walks the sessions)
        for _, _, seq, start, end in sorted(todo):
            if sent >= room:
                break
            got = self._submit(seq, start, end, room - sent, batch, protect, used)
            if got is None:
                break  # no archive room: the upkeep makes some (closed sessions' KV), or none is left
            sent += got  # 0: no DDR room for its copies down (its DDR blocks go first)
        self.pump_due = sent > 0 and over > sent
        return sent

    def _submit(
        self,
        seq: SeqId,
        start: int,
        end: int,
        room: int,
        batch: list[SeqId],
        protect: dict[SeqId, int],
        used: int | None = None,
    ) -> int | None:
        """Submit the unarchived blocks of `seq`'s block columns [start, end), at most about `room`
        of them, in batches; advance its cursor. Returns how many (0: no DDR room for the first
        block's copies down), None if the archive's capacity refused them. `used`: what counts
        against the capacity before this call's batches (`TierManager.ssd_used`), if the caller has it."""
        tiers = self.tiers
        b = tiers.blocks
        full_layers = b.full_layers  # (a sliding-window layer's blocks are not written behind)
        L = len(full_layers)
        if not L:
            return 0
        e = b.entries
        t = b.table(seq)
        span = 4 * max(1, room // L)  # columns looked at a time: a step's share, not a 128K context's
        while start < end:  # past the columns archived already (adopted, spilled)
            written = e.archived[t.ids[full_layers, start : min(end, start + span)]].all(axis=0)
            if not written.all():
                start += int(np.argmin(written))
                break
            start += len(written)
        self.cursor[seq] = start
        if start >= end:
            return 0
        cols = min(end - start, max(1, room // L))
        ids = t.ids[full_layers, start : start + cols]  # [L, cols]
        todo = ~e.archived[ids]  # (a block shared with other sessions: written once, its record this session's)
        if self.batches:  # nor again while another session's batch writes it
            todo &= ~self._in_flight(ids)
        # DDR room for the copies down: what lies below the watermark, cheap copies dropped for it
        # (perhaps of these blocks too: which need a copy down is read after the drops)
        free = self._ddr_room(int((todo & (e.ddr[ids] == NONE)).sum()), batch, protect)
        down = todo & (e.ddr[ids] == NONE)
        need = np.cumsum(down.sum(axis=0))  # copies down needed by the first c + 1 columns
        cols = int(np.searchsorted(need, free, side="right"))
        if cols == 0:
            return 0
        ids, todo, down = ids[:, :cols], todo[:, :cols], down[:, :cols]
        rows, offs = np.nonzero(todo)
        layers, blocks = full_layers[rows], offs + start
        # Layer-major: a layer's blocks lie in runs in the archive's segments, so that a resume
        # reads a layer (a dense one whole, `h3d.tiers.readahead`) in large sequential pieces.
        order = np.lexsort((blocks, layers))
        layers, blocks = layers[order], blocks[order]
        nbytes = len(blocks) * tiers.block_bytes
        if tiers.ssd_capacity is not None and tiers.archive is not None:
            live = (tiers.ssd_used() if used is None else used) + sum(x.bytes for x in self.batches)
            if live + nbytes > tiers.ssd_capacity:
                self.wants_room = live + nbytes - tiers.ssd_capacity
                return None
        self.wants_room = 0
        dr, dc = np.nonzero(down)
        if len(dr):
            hbm = e.hbm[ids[dr, dc]]
            slots = b.add_ddr_many(seq, full_layers[dr], dc + start)
            tiers.mover.hbm_to_ddr(hbm, slots)
        ready = tiers.mover.fence()  # every copy down and write to DDR enqueued so far
        name = tiers.sessions[seq].name
        for i in range(0, len(blocks), self.per_batch):
            bl, ly = blocks[i : i + self.per_batch], layers[i : i + self.per_batch]
            slots = e.ddr[t.ids[ly, bl]]
            assert (slots != NONE).all(), "a block written behind without its DDR copy"
            b.ddr_alloc.hold(slots)
            assert self._pool is not None
            digests = self.copy_up.digests(name, bl) if self.copy_up is not None else None
            future = self._pool.submit(self._write, ready, name, ly, bl, slots, digests)
            self.batches.append(_Batch(seq, ly, bl, slots, future, len(bl) * tiers.block_bytes, t.ids[ly, bl]))
            self._mark(self.batches[-1].ids, True)
        self.cursor[seq] = start + cols
        return len(blocks)

    def _in_flight(self, ids: np.ndarray) -> np.ndarray:
        """Which of the entries `ids` a batch in flight writes (a mask kept as batches come and
        go: a lookup, where a set test against every batch's entries sorted them all each call)."""
        if not len(self._writing):
            return np.zeros(ids.shape, dtype=bool)
        inside = ids < len(self._writing)
        return inside & self._writing[np.where(inside, ids, 0)]

    def _mark(self, ids: np.ndarray, writing: bool) -> None:
        if writing and len(ids) and int(ids.max()) >= len(self._writing):
            grown = np.zeros(max(int(ids.max()) + 1, 2 * len(self._writing)), dtype=bool)
            grown[: len(self._writing)] = self._writing
            self._writing = grown
        self._writing[ids] = writing

    def _ddr_room(self, want: int, batch: list[SeqId], protect: dict[SeqId, int]) -> int:
        """DDR slots the copies down may take now: those below the high watermark, cheap copies
        (an HBM or archive copy exists) dropped first where fewer than `want` are."""
        tiers = self.tiers
        alloc = tiers.blocks.ddr_alloc

        def room() -> int:
            return int(tiers.high_watermark * alloc.capacity) - (alloc.capacity - alloc.num_free)

        if want > 0 and room() < want:
            tiers.drop_cheap(want - max(room(), 0), tiers.eviction_order(batch, None), protect)
        return max(0, room())

    def _write(
        self,
        ready: list[torch.cuda.Event],
        name: str,
        layers: np.ndarray,
        blocks: np.ndarray,
        slots: np.ndarray,
        digests: list[str] | None = None,
    ) -> None:
        """A write-behind thread: the blocks' bytes from their held DDR slots into the archive, in
        bulk (`Archive.put_blocks`: a few calls that leave the GIL to the engine thread while they
        copy, compress and write, rather than several Python calls per block)."""
        self._wait_turn()
        for event in ready:
            event.synchronize()
        ddr = self.tiers.ddr
        k, v = ddr.read(torch.from_numpy(slots))  # [Hkv, n, bs, D], copies
        archive = self.tiers.archive
        assert archive is not None
        records = archive.put_blocks(name, layers, blocks, k, v)
        if digests is not None and self.copy_up is not None:
            self.copy_up.offer(layers.tolist(), digests, records)

    def poll(self, wait: bool = False, seq: SeqId | None = None) -> None:
        """Apply the finished batches (all of them, or `seq`'s, waited for with `wait`): blocks
        marked archived, slots let go; a failed batch's blocks stay dirty and degrade the SSD tier."""
        if wait:
            self.release()  # (a batch that waited for the hold would keep this thread waiting too)
        if not self.batches:
            return
        tiers = self.tiers
        b = tiers.blocks
        keep: list[_Batch] = []
        for x in self.batches:
            mine = seq is None or x.seq == seq
            if not (x.future.done() or (wait and mine)):
                keep.append(x)
                continue
            error = x.future.exception()  # waits
            b.ddr_alloc.let_go(x.slots)
            if x.abandoned:  # its session is gone: nothing to apply, its records deleted again
                if error is not None and not isinstance(error, ArchiveWriteFailed):
                    raise error
                if error is not None:
                    tiers.degrade(error)
                continue
            self._mark(x.ids, False)
            if error is not None:
                if not isinstance(error, ArchiveWriteFailed):
                    raise error
                tiers.degrade(error)
                if x.seq in self.cursor:
                    self.cursor[x.seq] = min(self.cursor[x.seq], int(x.blocks.min()))
                continue
            if b.has(x.seq):
                b.set_archived_many(x.seq, x.layers, x.blocks)
            self.written_blocks += len(x.blocks)
            tiers.counters.ssd_write_count += len(x.blocks)
        self.batches = keep
        if self._abandoned:
            self._bury()

    def flush(self, seq: SeqId, deadline: float | None = None) -> int:
        """Write `seq`'s dirty full blocks now on the write-behind threads, without the budget or
        the per-step bound (a shutdown's checkpoint: several threads compress, where a snapshot
        has one), until none is left or `deadline` (`time.monotonic()`) passes; what is in
        flight then is waited for. Returns the blocks it made durable."""
        tiers = self.tiers
        if not self.enabled or not tiers.writable:
            return 0
        self.release()
        t = tiers.blocks.table(seq)
        full = t.num_tokens // tiers.blocks.block_size
        before = int(np.count_nonzero(t.archived[:, :full]))
        while deadline is None or time.monotonic() < deadline:
            self.poll()
            start, room = min(self.cursor.get(seq, 0), full), self.max_in_flight - self.in_flight
            if start < full and room > 0 and self._submit(seq, start, full, room, [], {}) is None:
                break  # the archive's capacity: the snapshot writes the rest
            mine = [x for x in self.batches if x.seq == seq]
            if not mine:
                break  # all written (or no DDR room to copy the rest down: the snapshot writes it)
            mine[0].future.exception()  # the oldest done; the next poll applies it
        self.wait(seq)
        return int(np.count_nonzero(t.archived[:, :full])) - before

    def abandon(self, seq: SeqId, name: str) -> None:
        """`seq` (archived as `name`) is about to be purged: a purge does not wait for KV it
        deletes. Its batches not started yet are cancelled; those under way finish on their
        threads, their DDR slots held until then (released slots go back only once let go:
        `SlotAllocator.hold`), and nothing of theirs is applied. The records they write after the
        purge's tombstone are deleted again once the last of them is done (`poll`)."""
        keep: list[_Batch] = []
        for x in self.batches:
            if x.seq != seq:
                keep.append(x)
                continue
            self._mark(x.ids, False)  # (its entries are freed: others may write them meanwhile)
            if x.future.cancel():
                self.tiers.blocks.ddr_alloc.let_go(x.slots)
                continue
            x.abandoned = True
            keep.append(x)
        self.batches = keep
        if any(x.seq == seq for x in keep):
            self._abandoned[seq] = name
        self.cursor.pop(seq, None)
        self.urgent.discard(seq)

    def _bury(self) -> None:
        """Purged sessions whose last abandoned batch is done: their records deleted again (one
        tombstone each, where the batches wrote any)."""
        left = {x.seq for x in self.batches if x.abandoned}
        archive = self.tiers.archive
        for seq in [s for s in self._abandoned if s not in left]:
            name = self._abandoned.pop(seq)
            if archive is not None and self.tiers.writable:
                try:
                    archive.remove(name)
                except ArchiveWriteFailed as err:
                    self.tiers.degrade(err)

    def wait(self, seq: SeqId) -> None:
        """`seq`'s batches in flight done and applied (the others' applied if done)."""
        if any(x.seq == seq for x in self.batches):
            self.poll(wait=True, seq=seq)

    def cut(self, seq: SeqId, num_tokens: int) -> None:
        """`seq`'s KV is about to be cut back to `num_tokens` tokens: its batches in flight done
        first (applied), its cursor moved back."""
        self.wait(seq)
        if seq in self.cursor:
            self.cursor[seq] = min(self.cursor[seq], num_tokens // self.tiers.blocks.block_size)

    def look_again(self, seqs: set[SeqId]) -> None:
        """Blocks of `seqs` that were shared (and so passed over) may be theirs alone now: their
        cursors go back to their first block (the columns archived already are skipped quickly)."""
        for seq in seqs:
            self.cursor.pop(seq, None)

    def forget(self, seq: SeqId) -> None:
        """`seq` is about to be released: its batches in flight done first (applied)."""
        self.wait(seq)
        self.cursor.pop(seq, None)
        self.urgent.discard(seq)

    def stats(self) -> WriteBehindStats:
        b = self.tiers.blocks
        e = b.entries
        dirty = np.zeros(e.capacity, dtype=bool)  # (a block several sessions share: once)
        for t in b.tables().values():
            full = t.num_tokens // b.block_size
            ids = t.ids[b.full_layers, :full]
            dirty[ids[~e.archived[ids]]] = True
        lag = 0.0 if self._over_since is None else time.monotonic() - self._over_since
        bb = self.tiers.block_bytes
        return WriteBehindStats(int(dirty.sum()) * bb, self.in_flight * bb, self.written_blocks * bb, lag)

    def close(self) -> None:
        if self._pool is not None:
            self.poll(wait=True)
            self._pool.shutdown(wait=True)
