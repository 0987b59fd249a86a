"""The engine's upkeep of KV in the SSD archive: a closed or purged session's KV, the archive
kept within its capacity, and damaged blocks computed again.

All of it acts on KV only: a session's tokens (its token log) are the truth, so what is dropped
here is computed again from them. `park_kv` / `purge_kv`: a session's KV when it is closed /
purged (without a writable archive, closing forgets it; a refused purge leaves its records,
unreachable); `enforce_ssd_capacity` forgets the archived KV of closed sessions past
`ssd_capacity_mb` or for the room write-behind needs (and asks the archive's own thread to
reclaim the disk space), coldest first (`forget_coldest`, also what admission forgets for
room); `BlockRepair` rewrites a block whose archive record is damaged (a damaged block is never
used). The last two record what they did in lists the engine holds (`Engine.evictions`,
`Engine.rebuilds`), which the daemon logs and clears.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from h3d.engine.runner import ModelRunner
from h3d.engine.session import Session, SessionId
from h3d.errors import H3Error, SsdDegraded
from h3d.kv.blocks import SeqId
from h3d.kv.cache import KVCache
from h3d.tiers.identity import ArchiveCorrupt, ArchiveWriteFailed, BlockKey


def park_kv(kv: KVCache, seq: SeqId) -> None:
    """A closed session's KV: unpinned, to the archive only (or forgotten, to be computed again,
    without a writable archive)."""
    kv.pin(seq, None)
    try:
        if not kv.writable:
            raise SsdDegraded("no writable archive")
        kv.park(seq)
    except SsdDegraded:
        kv.forget(seq)


def purge_kv(kv: KVCache, seq: SeqId) -> None:
    """A purged session's KV forgotten, its archive records with it (by a tombstone)."""
    if kv.archive is not None and not kv.writable:
        kv.retry_ssd()  # the purge's tombstone is an archive write
    try:
        kv.release(seq)  # forgets the rest of the session even if the tombstone fails
    except ArchiveWriteFailed as e:  # the tombstone was refused: the records stay, unreachable
        kv.degrade(e)


def sweep_archive(kv: KVCache, sessions: set[str]) -> int:
    """At start, with token logs: the archived blocks of sessions that have none (a prefix cache's
    sessions, which keep no log, left by a daemon that was killed; a purge whose tombstone
    failed) are deleted, their space given back by a compaction. Returns the blocks deleted."""
    archive = kv.archive
    if archive is None or not kv.writable:
        return 0
    gone = sum(archive.remove(name) for name in archive.sessions() - sessions)
    if gone:
        archive.compact_later()
    return gone


def forget_coldest(
    kv: KVCache, sessions: Iterable[Session], evictions: list[SessionId], keep: Session | None = None
) -> bool:
    """Forget the archived KV of the closed session (not `keep`) used least recently that has
    any (its tokens stay: the KV is computed again if it is reopened), recorded in `evictions`.
    Returns False where there is none. Raises ArchiveWriteFailed if its records' tombstone is
    refused (they stay)."""
    closed = [s for s in sessions if s.closed and s is not keep and kv.cached_tokens(s.seq)]
    if not closed:
        return False
    coldest = min(closed, key=lambda s: s.last_used_at)
    kv.forget(coldest.seq)
    evictions.append(coldest.id)
    return True


def enforce_ssd_capacity(kv: KVCache, sessions: Iterable[Session], evictions: list[SessionId]) -> None:
    """Past the archive's capacity (`ssd_capacity_mb`, resolved: `TierManager.ssd_capacity`) of
    live records and digest snapshots (`TierManager.ssd_used`), or short of the room write-behind
    asked for (open sessions' blocks come first):
    forget the archived KV of closed sessions, least recently used first (their tokens stay; the
    KV is computed again if they are reopened); then reclaim the disk space of dead records."""
    archive = kv.archive
    capacity = kv.tiers.ssd_capacity
    if archive is None or capacity is None or not kv.writable:
        return
    wanted = kv.tiers.behind.wants_room
    limit = capacity - wanted
    try:
        used = kv.tiers.ssd_used
        sessions = list(sessions)
        while used() > limit and forget_coldest(kv, sessions, evictions):
            pass
        if wanted and used() <= limit:
            kv.tiers.behind.wants_room = 0
        disk = archive.disk_bytes()
        # Worth copying the live records; on the archive's own thread (the engine thread only
        # asks: a compaction copies records for as long as they take); not while one is asked
        # for or runs (next check, then).
        if disk > capacity and disk - archive.live_bytes() >= capacity / 10 and not archive.compacting:
            archive.compact_later(keep_ratio=1.0)
    except ArchiveWriteFailed as e:
        kv.degrade(e)


class BlockRepair:
    """The damaged blocks' KV computed again, each at most once (`tried`); what was done is
    appended to `rebuilds` (the engine's list)."""

    def __init__(self, runner: ModelRunner, rebuilds: list[str]) -> None:
        self.runner, self.kv = runner, runner.kv
        self.rebuilds = rebuilds  # why KV was dropped to be prefilled again (the daemon logs them)
        self.tried: set[BlockKey] = set()  # damaged records already dropped once

    def repair_for(self, exc: ArchiveCorrupt, sessions: Mapping[SessionId, Session]) -> bool:
        """A step met the damaged record `exc` names: repair its block (True: the step may run
        again), unless it names no session of `sessions` or was met before (False: the step's
        requests fail)."""
        session = sessions.get(SessionId(exc.key.session)) if exc.key is not None else None
        if session is None or exc.key in self.tried:
            return False
        assert exc.key is not None
        self.repair(session, exc.key, str(exc))
        return True

    def repair(self, session: Session, key: BlockKey, reason: str) -> None:
        """Compute the KV of the damaged block `key` again from `session`'s tokens, in every
        layer, over the blocks before it; a damaged block met on the way is rewritten first.
        Only those blocks are recomputed (`kv_rebuild_blocks` counts them). If that cannot be
        done (no room), the session's KV is cut back to the block, to be prefilled again."""
        bs = self.kv.block_size
        cached = self.kv.cached_tokens(session.seq)
        todo = [key]
        while todo:
            block = todo[-1].index
            self.tried.add(todo[-1])
            try:
                self.runner.rewrite(session.seq, block, session.tokens[block * bs : min((block + 1) * bs, cached)])
            except H3Error as exc:
                if isinstance(exc, ArchiveCorrupt) and exc.key is not None and exc.key not in self.tried:
                    todo.append(exc.key)  # an earlier block of the session: rewritten first
                    continue
                self.rebuild_from(session, min(k.index for k in todo), f"{reason}; rewriting it failed: {exc}")
                return
            done = todo.pop()
            self.kv.count_rebuilt(1)
            self.rebuilds.append(f"{reason}: block {done.index} of session {session.id} was computed again")
            reason = f"while rewriting block {done.index}"

    def rebuild_from(self, session: Session, block: int, reason: str) -> None:
        """Forget `session`'s KV from `block` on (every layer); its next step prefills it again."""
        dropped = self.kv.rebuild_from(session.seq, block)
        self.rebuilds.append(f"{reason}: {dropped} blocks of session {session.id} are prefilled again")
