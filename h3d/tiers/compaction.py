"""Archive compaction: the space of dead records given back, beside puts, deletes and reads.

`compact(archive, keep_ratio)` (what `Archive.compact` runs) works in three phases:
1. plan, under the archive's write lock: the victims are the segments less than `keep_ratio` live
   and those with no live record (never the active one: if it is a victim, a new active segment
   is started first, so that no record is appended to a victim); their live records, in file
   order; a new segment number for the copies;
2. copy, with no lock: the records' bytes as they are (checksums kept; a record several sessions'
   keys point at, once) into the new segment,
   fsynced, and the folder fsynced; puts, deletes and reads go on meanwhile (victims take no
   appends, and only a compaction deletes segments, one compaction at a time);
3. switch, under the write lock: the records still current (not superseded or deleted during
   phase 2: those stay where they were, their copies dead) are pointed at their copies by a
   rewritten manifest (fsynced, renamed over the old one, the index following at once), then the
   segments no live entry points into are deleted. If no record moved, nothing is rewritten.
A crash at any point leaves a store that opens to the same contents: before the rename, the old
manifest names only the old places (the new segment's bytes are uncommitted and cut at open);
after it, the new one names only fsynced copies; segments deleted only once nothing live points
into them, and those a crash left behind are deleted at the next open. `Archive.close` stops a
compaction between two records (its copies are deleted: nothing names them).

Where it runs: `Archive.compact` in the calling thread; `Archive.compact_later` on the archive's
own thread (`Compactor`), so the engine thread only asks. One background thread runs the
compactions asked for, one at a time, and requests that arrive while one runs are merged into the
next (the largest keep ratio wins). A failure is logged and kept (`CompactionStats.last_error`),
never raised to whoever asked: a compaction that stopped leaves the store as it was, and one whose
switch failed leaves the archive refusing writes until `recover`, as any failed write does (the
tier manager sees it at its next write).

Seams: every file system call goes through the archive's `files` (`h3d.store.files.FileOps`), the
copies are written in pieces of the archive's `copy_chunk_bytes` (`COPY_CHUNK_BYTES` by default),
and the archive's `compaction_hooks` (`CompactionHooks`) are called at the points they name; the
background thread's counters are `Compactor.stats` (`Archive.compaction_stats`).

`RECLAIM_KEEP_RATIO`: a segment is rewritten once more than a quarter of it is dead. Copying its
live three quarters costs at most three bytes written per byte freed, and afterwards every segment is at
least three quarters live, so the disk holds at most 4/3 of the live records (plus what was
deleted while the compaction ran). A segment with no live record left goes without any copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from h3d.tiers.identity import ArchiveCorrupt, BlockKey, describe
from h3d.tiers.manifest import puts_entry
from h3d.tiers.segments import Loc, segment_sizes

if TYPE_CHECKING:
    from h3d.tiers.archive import Archive

PUTS_PER_LINE = 4096  # records per line of a rewritten manifest (one session's each)

log = logging.getLogger(__name__)

RECLAIM_KEEP_RATIO = 0.75
COPY_CHUNK_BYTES = 8 * 2**20  # the copies are written in pieces of about this size (by default)

Plan = tuple[list[int], list[tuple[BlockKey, Loc]], int | None, dict[int, int]]


class CompactionHooks:
    """Where a caller steps into a compaction (`Archive(compaction_hooks=...)`): a test pausing one
    midway to act beside it, a benchmark timing its phases. Each method runs on the compacting
    thread with no archive lock held, so puts, deletes and reads go on while it runs; what it raises
    stops the compaction as a failure at that point would (the store stays as it was, the copies
    are deleted). The default does nothing."""

    def copied(self, segment: int, records: int) -> None:
        """Phase 2 is done: `records` live records are copied into segment `segment`, fsynced, and its
        name is durable; the switch (phase 3) has not begun."""


@dataclass(frozen=True, slots=True)
class CompactionStats:
    """A `Compactor`'s counters since it started."""

    runs: int  # background compactions completed
    freed_bytes: int  # what they freed on disk
    last_error: str | None  # the last one's failure, if one failed


def compact(a: Archive, keep_ratio: float) -> int:
    """See the module's docstring. Returns the bytes freed on disk (segments deleted less the copies
    written); 0 if there was nothing to do or `close` stopped it."""
    with a._compact_lock:
        plan = _plan(a, keep_ratio)
        if plan is None:
            return 0
        victims, moving, target, sizes = plan
        try:
            copies = _copy_records(a, moving, target) if target is not None else None
            if copies is None and target is not None:  # stopped by close
                _drop_unnamed(a, target)
                return 0
            if target is not None and copies is not None:
                a._compaction_hooks.copied(target, len(_records(copies)))
            copies = copies or []
            with a._writing():  # the index changes only under this lock: read here without `_state`
                moved = [
                    (key, new)
                    for (key, old), new in zip(moving, copies, strict=True)
                    if a._index.get(key.session, {}).get((key.layer, key.index)) == old
                ]
                entries = []
                if moved:
                    now = {key: new for key, new in moved}
                    for s, blocks in a._index.items():  # one `puts` line per session (a piece of it)
                        items = list(blocks.items())
                        for i in range(0, len(items), PUTS_PER_LINE):
                            piece = items[i : i + PUTS_PER_LINE]
                            keys = [BlockKey(s, li[0], li[1]) for li, _ in piece]
                            locs = [now.get(key, loc) for key, (_, loc) in zip(keys, piece, strict=True)]
                            entries.append(puts_entry(s, keys, locs))
                if moved:
                    a._rewrite_manifest(entries, moved)
                with a._state:
                    gone = [n for n in [*victims, *([target] if target else [])] if not a._live.get(n, 0)]
                for n in gone:
                    a.files.unlink(a._seg_path(n), missing_ok=True)
                with a._state:
                    for n in gone:
                        a._live.pop(n, None)
                a.files.fsync_dir(a.path)
        except BaseException:
            if target is not None:
                _drop_unnamed(a, target)
            raise
    written = sum(_records(copies).values())
    freed = sum(sizes.get(n, written if n == target else 0) for n in gone) - written
    log.info(
        "KV archive %s: compaction moved %d records, deleted %d segments, freed %d bytes",
        a.path, len(moved), len(gone), freed,
    )  # fmt: skip
    return freed


def _records(locs: list[Loc]) -> dict[tuple[int, int], int]:
    """The distinct records among `locs` (several keys may point at one): (segment, offset) -> length."""
    return {(x.segment, x.offset): x.length for x in locs}


def _drop_unnamed(a: Archive, target: int) -> None:
    """Delete the copies' segment if no live entry points into it (the manifest never switched to it)."""
    with a._state:
        named = a._live.get(target, 0) > 0
    if not named:
        with contextlib.suppress(OSError):
            a.files.unlink(a._seg_path(target))


def _plan(a: Archive, keep_ratio: float) -> Plan | None:
    """Phase 1: (victims, their live records in file order, the copies' segment or None, segment sizes)."""
    with a._writing():  # the index changes only under this lock: read here without `_state`
        sizes = segment_sizes(a.path)
        victims = sorted(
            n for n, size in sizes.items()
            if (size and a._live.get(n, 0) < keep_ratio * size) or (not a._live.get(n, 0) and n != a._seg_no)
        )  # fmt: skip
        chosen = set(victims)
        moving = sorted(
            ((BlockKey(s, li[0], li[1]), loc) for s, blocks in a._index.items()
             for li, loc in blocks.items() if loc.segment in chosen),
            key=lambda m: (m[1].segment, m[1].offset),
        )  # fmt: skip
        if not victims:
            return None
        if a._seg_no in chosen:
            a._rotate()
        target = None
        if moving:
            target, a._next_no = a._next_no, a._next_no + 1
        return victims, moving, target, sizes


def _copy_records(a: Archive, moving: list[tuple[BlockKey, Loc]], target: int) -> list[Loc] | None:
    """Phase 2: the records into the new segment `target`, fsynced. -> their new places, in order;
    None if `close` stopped it."""
    fd = a.files.create(a._seg_path(target), os.O_WRONLY)
    sources: dict[int, int] = {}
    try:
        copies: list[Loc] = []
        chunk: list[bytes] = []
        offset = flushed = 0
        done: dict[tuple[int, int], Loc] = {}  # a record linked to by several keys is copied once
        for key, loc in moving:
            if a._stopping.is_set():
                return None
            copy = done.get((loc.segment, loc.offset))
            if copy is not None:
                copies.append(dataclasses.replace(copy, home=loc.home))
                continue
            if loc.segment not in sources:
                sources[loc.segment] = a.files.open(a._seg_path(loc.segment), os.O_RDONLY)
            data = os.pread(sources[loc.segment], loc.length, loc.offset)
            if len(data) != loc.length:
                raise ArchiveCorrupt(
                    f"{describe(key)}: {a._seg_path(loc.segment)} is shorter than the manifest says; "
                    "compaction stopped", key,
                )  # fmt: skip
            chunk.append(data)
            copy = done[(loc.segment, loc.offset)] = Loc(target, offset, loc.length, loc.num_tokens, loc.codec, loc.crc)
            copies.append(dataclasses.replace(copy, home=loc.home))
            offset += loc.length
            if offset - flushed >= a._copy_chunk_bytes:
                a.files.write_all(fd, b"".join(chunk), flushed)
                chunk, flushed = [], offset
        a.files.write_all(fd, b"".join(chunk), flushed)
        a.files.fsync(fd)
    finally:
        os.close(fd)
        for src in sources.values():
            os.close(src)
    a.files.fsync_dir(a.path)  # the new file's name is durable before any manifest names it
    return copies


class Compactor:
    """One background thread calling `compact(keep_ratio)` when asked; started on the first request."""

    def __init__(self, compact: Callable[[float], int], name: str) -> None:
        self._compact = compact
        self._name = name
        self._cond = threading.Condition()
        self._wanted: float | None = None  # the keep ratio of the next run; None: nothing asked
        self._running = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._runs = 0
        self._freed_bytes = 0
        self._last_error: str | None = None

    def request(self, keep_ratio: float) -> None:
        """Run a compaction soon; returns at once. Ignored once closed."""
        with self._cond:
            if self._closed:
                return
            self._wanted = keep_ratio if self._wanted is None else max(self._wanted, keep_ratio)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="h3d-compact", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def stats(self) -> CompactionStats:
        """The compactions this thread ran: completed, bytes freed, the last failure (a snapshot)."""
        with self._cond:
            return CompactionStats(self._runs, self._freed_bytes, self._last_error)

    @property
    def busy(self) -> bool:
        """A compaction runs or is asked for."""
        with self._cond:
            return self._running or self._wanted is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no compaction runs or is asked for. -> False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._running or self._wanted is not None), timeout)

    def close(self) -> None:
        """Take no more requests and wait for the thread (the caller makes a running compaction stop
        early: `Archive.close` sets the event it checks between records)."""
        with self._cond:
            self._closed = True
            self._wanted = None
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._wanted is not None)
                if self._closed:
                    return
                keep_ratio, self._wanted, self._running = self._wanted, None, True
            assert keep_ratio is not None
            try:
                freed = self._compact(keep_ratio)
                with self._cond:
                    self._runs += 1
                    self._freed_bytes += freed
            except Exception as e:  # logged, never raised: see the module's docstring
                log.warning("%s: background compaction failed: %s", self._name, e)
                with self._cond:
                    self._last_error = str(e)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()
