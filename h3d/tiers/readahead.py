"""Read-ahead: a resumed session's archived blocks read back into DDR in the background.

A session resumed from the archive (after a restart, or closed and reopened) takes its digests
from its snapshot (`h3d.tiers.digestfile`), and its first steps read from the archive only the
blocks they select (`TierManager.stage`). The rest comes back here, after that first step: its
archive-only blocks, every layer, in pieces of `READ_AHEAD_PIECE` records on threads of their
own (`READ_AHEAD_THREADS`, beside the steps' own reads on the mover's), into DDR slots taken for
them, only while DDR is below `ddr_high_watermark` (read-ahead never evicts anything). While
requests run a step submits at most `READ_AHEAD_STEP_MB`; at most `READ_AHEAD_IN_FLIGHT_MB` is in
flight. Once every block of a session is in HBM or DDR, its steps plan on the device again (a
CUDA graph) instead of on the host.

A finished piece's slots join the session's table at the next `poll` (the engine thread). A
step that needs a block of a piece still in flight waits for that piece (`wait_for`), then reads
it as read ahead: the tokens are those of an uninterrupted run. A step that reads the archive
first takes back the pieces of other sessions that have not started (`yield_to`): its own reads
and its sessions' pieces go first on the disk.

What must stay true: a slot read into has no owner (`SlotAllocator.take`: neither free nor any
session's) until its piece is applied; a block that got a DDR copy meanwhile (a step staged it)
keeps that one and the slot read ahead is given back; a session's pieces in flight are waited for
and given back before its KV is cut, parked or released (`drop`).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from h3d.kv.blocks import NONE, NULL_ENTRY, SeqId
from h3d.tiers.identity import ArchiveCorrupt, BlockKey

if TYPE_CHECKING:
    from h3d.tiers.manager import TierManager

# Eight, as the step's own reads (`h3d.tiers.mover.READ_THREADS`): a cold disk gives one run of
# 128 KiB records 1.41-1.62 GB/s on four threads and 1.89-1.95 on eight (H100 host,
# `python -m h3d.bench.archive_read`, docs/BENCHMARKS.md)
READ_AHEAD_THREADS = max(1, min(8, os.cpu_count() or 1))
READ_AHEAD_PIECE = 64  # records per piece (one `Archive.get_bytes`)
READ_AHEAD_STEP_MB = 64  # submitted per step while requests run
# Submitted and not yet applied, at most: a step that stages its own reads meanwhile (a session
# asked for while another one is read ahead) queues behind these on the disk, 256 MiB being
# about 0.15 s at 1.7 GB/s (1 GiB before: 0.6 s; docs/BENCHMARKS.md, the restarts of 2026-12-06).
READ_AHEAD_IN_FLIGHT_MB = 256


@dataclass(slots=True)
class _Piece:
    seq: SeqId
    layers: np.ndarray
    blocks: np.ndarray
    slots: np.ndarray  # taken for the read: no owner until applied
    future: Future[None]
    first: bool  # of what the session's next step reads for sure (`start`'s `first`)


class ReadAhead:
    def __init__(self, tiers: TierManager) -> None:
        self.tiers = tiers
        self.queue: list[SeqId] = []  # sessions to read back, oldest request first
        self.first: dict[SeqId, np.ndarray] = {}  # [L, blocks] what a session's next step reads for sure
        # [L, blocks] what a session started at a restart leaves to its first use (`start`'s `skip`)
        self.skip: dict[SeqId, np.ndarray] = {}
        self.pieces: list[_Piece] = []
        self.read_blocks = 0  # applied since start
        self.yielded_blocks = 0  # taken back before they were read, for a step's own reads (`yield_to`)
        self._pool: ThreadPoolExecutor | None = None
        # Per session read back: when `start` queued it, the blocks applied, the pieces of its
        # `first` blocks not applied yet (its `read_ahead_first` event once none is left)
        self._began: dict[SeqId, float] = {}
        self._applied: dict[SeqId, int] = {}
        self._first_left: dict[SeqId, int] = {}

    @property
    def in_flight(self) -> int:
        return sum(len(p.blocks) for p in self.pieces)

    def start(self, seq: SeqId, first: np.ndarray | None = None, skip: np.ndarray | None = None) -> None:
        """Read `seq`'s archive-only blocks back from now on (`pump`), layer by layer; `first`
        ([L, blocks] bool): the blocks its next step reads whatever its query (the dense layers
        whole, sinks, recent window and prompt anchors: `Policy.known`), submitted at once, all
        of them, before the rest. Its first step waits for the pieces that hold what it reads
        rather than reading those blocks again. `skip` ([L, blocks] bool): blocks left out until
        `start` is called for `seq` again (a restart's read-ahead leaves the records a session
        links to another's to its first use, which shares that one's copies: `KVCache.rebase`)."""
        if self.tiers.archive is None:
            return
        if seq in self.queue:
            self.skip.pop(seq, None)
            return
        self.queue.append(seq)
        self._began[seq] = time.monotonic()
        self._applied[seq] = 0
        if first is not None:
            self.first[seq] = first
        if skip is not None:
            self.skip[seq] = skip
        self.pump(busy=False)

    def pump(self, busy: bool) -> int:
        """Apply the finished pieces, then submit more (at most `READ_AHEAD_STEP_MB` when `busy`)
        within the room below DDR's high watermark. Returns the blocks submitted."""
        self.poll()
        if not self.queue:
            return 0
        tiers = self.tiers
        b = tiers.blocks
        alloc = b.ddr_alloc
        block = tiers.block_bytes
        room = int(tiers.high_watermark * alloc.capacity) - (alloc.capacity - alloc.num_free)
        for seq in [s for s in self.queue if s in self.first]:  # what next steps read for sure: all of it now
            todo = self._todo(seq)
            first = self.first.pop(seq)
            n = min(todo.shape[1], first.shape[1])  # (the session may have grown since)
            todo[:, :n] &= first[:, :n]
            todo[:, n:] = False
            layers, blocks = np.nonzero(todo)
            layers, blocks = layers[: max(room, 0)], blocks[: max(room, 0)]
            room -= self._submit(seq, layers, blocks, first=True)
            self._first_done(seq)  # (nothing of it was left to read)
        room = min(room, (READ_AHEAD_IN_FLIGHT_MB << 20) // block - self.in_flight)
        if busy:
            room = min(room, max(1, (READ_AHEAD_STEP_MB << 20) // block))
        sent = 0
        for seq in list(self.queue):
            if room - sent <= 0:
                break
            todo = self._todo(seq)
            layers, blocks = np.nonzero(todo)
            if not len(blocks) and not any(p.seq == seq for p in self.pieces):
                self.queue.remove(seq)  # all of it back (but what it skips)
                self.skip.pop(seq, None)
                self._done(seq)
                continue
            layers, blocks = layers[: room - sent], blocks[: room - sent]
            sent += self._submit(seq, layers, blocks)
        return sent

    def _todo(self, seq: SeqId) -> np.ndarray:
        """[L, blocks] what is left to read of `seq`: archive-only, not in flight, not its
        partial block (staged by its next append)."""
        b = self.tiers.blocks
        t = b.table(seq)
        todo = t.archive_only()
        if t.num_tokens % b.block_size:
            todo[:, t.num_tokens // b.block_size] = False
        skip = self.skip.get(seq)
        if skip is not None:
            n = min(todo.shape[1], skip.shape[1])
            todo[:, :n] &= ~skip[:, :n]
        for p in self.pieces:
            if p.seq == seq:
                todo[p.layers, p.blocks] = False
        return todo

    def _notice(self, event: str, seq: SeqId) -> None:
        began, blocks = self._began.get(seq), self._applied.get(seq, 0)
        if began is None or not blocks or not self.tiers.blocks.has(seq):
            return  # (nothing read ahead: no event)
        self.tiers.notices.append((event, {
            "session": self.tiers.sessions[seq].name, "blocks": blocks,
            "gb": round(blocks * self.tiers.block_bytes / 1e9, 3),
            "seconds": round(time.monotonic() - began, 3),
        }))  # fmt: skip

    def _first_done(self, seq: SeqId) -> None:
        """`read_ahead_first`: every piece of what `seq`'s next step reads for sure is applied."""
        if self._first_left.get(seq) == 0:
            del self._first_left[seq]
            self._notice("read_ahead_first", seq)

    def _done(self, seq: SeqId) -> None:
        """`read_ahead_done`: all of `seq`'s archive-only KV is back in DDR (or read by its steps)."""
        self._first_left.pop(seq, None)
        self._notice("read_ahead_done", seq)
        self._began.pop(seq, None)
        self._applied.pop(seq, None)

    def _submit(self, seq: SeqId, layers: np.ndarray, blocks: np.ndarray, first: bool = False) -> int:
        tiers = self.tiers
        name = tiers.sessions[seq].name
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_AHEAD_THREADS, thread_name_prefix="h3d-read-ahead")
        for i in range(0, len(blocks), READ_AHEAD_PIECE):
            ly, bl = layers[i : i + READ_AHEAD_PIECE], blocks[i : i + READ_AHEAD_PIECE]
            slots = tiers.blocks.ddr_alloc.take(len(bl))
            keys = [BlockKey(name, int(la), int(j)) for la, j in zip(ly, bl, strict=True)]
            future = self._pool.submit(tiers.mover.read_into, keys, slots, tiers.mover.fence())
            self.pieces.append(_Piece(seq, ly, bl, slots, future, first))
        if first:
            self._first_left[seq] = self._first_left.get(seq, 0) + -(-len(blocks) // READ_AHEAD_PIECE)
        return len(blocks)

    def poll(self, wait: bool = False, seq: SeqId | None = None) -> None:
        """Apply the finished pieces (all of them, or `seq`'s, waited for with `wait`): each block
        still archive-only takes its slot; the other slots are given back. A piece that failed
        (a damaged record) is given back whole: the step that needs its blocks reads them itself
        and meets the damage there, where it is repaired."""
        if not self.pieces:
            return
        b = self.tiers.blocks
        keep: list[_Piece] = []
        firsts: list[SeqId] = []
        for p in self.pieces:
            mine = seq is None or p.seq == seq
            if not (p.future.done() or (wait and mine)):
                keep.append(p)
                continue
            if p.first and p.seq in self._first_left:
                self._first_left[p.seq] -= 1
                firsts.append(p.seq)
            error = p.future.exception()  # waits
            if error is not None and not isinstance(error, (ArchiveCorrupt, KeyError)):
                b.ddr_alloc.let_go(p.slots)
                raise error
            if error is not None or not b.has(p.seq):
                b.ddr_alloc.let_go(p.slots)
                continue
            t = b.table(p.seq)
            ids = t.ids[p.layers, p.blocks]
            # (a block freed meanwhile, behind a sliding window, points at the null entry: not placed)
            fresh = (b.entries.hbm[ids] == NONE) & (b.entries.ddr[ids] == NONE) & (ids != NULL_ENTRY)
            b.ddr_alloc.let_go(p.slots[~fresh])
            if fresh.any():
                b.place_ddr_many(p.seq, p.layers[fresh], p.blocks[fresh], p.slots[fresh])
                self.read_blocks += int(fresh.sum())
                self._applied[p.seq] = self._applied.get(p.seq, 0) + int(fresh.sum())
                self.tiers.counters.ssd_read_count += int(fresh.sum())
                self.tiers.sessions[p.seq].counters.ssd_read_count += int(fresh.sum())
        self.pieces = keep
        for one in dict.fromkeys(firsts):
            self._first_done(one)

    def yield_to(self, batch: list[SeqId]) -> int:
        """A step is about to read the archive for `batch`: the pieces of other sessions not
        started yet are taken back (their slots given back; `pump` submits their blocks again
        later), so that the step's reads, and its sessions' own pieces, do not queue behind them
        on the disk. A restart's read-ahead submits every open session's next-step blocks at once,
        the most recently used first: the first session asked for, if it was used earlier, waited
        for all of them (4 GB of other sessions' reads in its 7 s first step at 128K on an H100
        host, docs/BENCHMARKS.md). Returns the blocks taken back."""
        keep: list[_Piece] = []
        back = 0
        for p in self.pieces:
            if p.seq not in batch and p.future.cancel():  # (never started: never will)
                self.tiers.blocks.ddr_alloc.let_go(p.slots)
                back += len(p.blocks)
                if p.first and p.seq in self._first_left:  # submitted again with the next `first`
                    self._first_left[p.seq] -= 1
                    mask = self.first.get(p.seq)
                    if mask is None:
                        shape = (self.tiers.blocks.num_layers, self.tiers.blocks.table(p.seq).num_blocks)
                        mask = self.first[p.seq] = np.zeros(shape, dtype=bool)
                    mask[p.layers, p.blocks] = True
            else:
                keep.append(p)
        self.pieces = keep
        self.yielded_blocks += back
        return back

    def wait_for(self, seq: SeqId, layer: int, blocks: np.ndarray) -> None:
        """A step is about to read `blocks` of `seq`'s `layer`: the pieces in flight that hold any
        of them are waited for and applied."""
        hit = [
            p
            for p in self.pieces
            if p.seq == seq and np.isin(p.blocks[p.layers == layer], blocks, assume_unique=False).any()
        ]
        for p in hit:
            p.future.exception()
        if hit:
            self.poll()

    def drop(self, seq: SeqId, stop: bool = True) -> None:
        """`seq`'s KV is about to be cut, parked or released: its pieces in flight are waited for
        and given back, and (with `stop`) it reads nothing more ahead until `start` again."""
        if stop and seq in self.queue:
            self.queue.remove(seq)
            self.first.pop(seq, None)
            self.skip.pop(seq, None)
            self._began.pop(seq, None)
            self._applied.pop(seq, None)
        self._first_left.pop(seq, None)  # (its pieces are given back unread)
        mine = [p for p in self.pieces if p.seq == seq]
        if not mine:
            return
        for p in mine:
            p.future.exception()
            self.tiers.blocks.ddr_alloc.let_go(p.slots)
        self.pieces = [p for p in self.pieces if p.seq != seq]

    def close(self) -> None:
        for p in self.pieces:
            p.future.exception()
            self.tiers.blocks.ddr_alloc.let_go(p.slots)
        self.pieces = []
        self.queue = []
        self.first = {}
        self.skip = {}
        self._began, self._applied, self._first_left = {}, {}, {}
        if self._pool is not None:
            self._pool.shutdown(wait=True)
