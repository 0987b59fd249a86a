"""The token logs' copies in the remote store, kept up with the local files.

With the remote tier on, a session's token log in the store is its truth, and the local file
(`h3d.store.tokenlog.TokenStore`) the copy this daemon writes first: every byte the file gets is
appended to the store's log after it, in the same order, by this module's thread (an asyncio loop
of its own, on uvloop, driving `h3d.remote.store.RemoteStore`), so that nothing the engine thread
does waits for the store. The file is the queue: what the store lacks is read back from the file
(`os.pread` of the bytes past what the store acknowledged), so a store that is down or slow costs
no memory here, and when it is back the copy catches up by itself.

What must stay true:
- the store's log is a prefix of the file's at every moment (the same bytes, appended in order,
  each append checked against the length the store reports: another writer is never papered over);
- `durable(session, size)` resolves only once the store acknowledged the file's first `size`
  bytes (under `appendfsync always`, on its disk: `RemoteStore.check_durable`); in `sync` mode it
  fails after `timeout_s` instead (the daemon then ends the stream with UNAVAILABLE, never showing
  a token the store does not hold);
- a session's log is written under its lease only (`take`), renewed every third of `lease_s`; a
  lease found gone (`Fenced`) stops the writes for that session and is reported (`lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from h3d.remote.store import (
    DIGEST_PIECE_BYTES,
    Fenced,
    Held,
    Lease,
    RemoteError,
    RemoteStore,
    RemoteUnavailable,
    digests_whole,
)
from h3d.store.files import replace_file
from h3d.store.tokenlog import parse_log

log = logging.getLogger(__name__)

T = TypeVar("T")

APPEND_MAX_BYTES = 4 << 20  # the most one append sends (a long log catching up goes in pieces)
RETRY_S = 1.0  # a failed append or renewal is tried again after this long
KV_RESUME = ("auto", "store", "recompute")  # `remote_kv_resume`
RATE_MIN_BYTES = 16 << 20  # a read of the store this large measures its rate (`RemoteLogs.note_read`)


@dataclass
class _Log:
    """One session's copy: its lease, what the store holds, what the file holds, who waits."""

    lease: Lease
    path: Path
    stored: int  # bytes the store acknowledged
    local: int  # bytes the file holds (as told by `written`)
    waiters: list[tuple[int, Future[None]]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    lost: str | None = None  # why the lease is gone: nothing more is written
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one append in flight at a time


class RemoteLogs:
    """See the module's docstring. `path_of(session)`: the session's local log file. Every method
    may be called from any thread but the store's own; the blocking ones wait at most
    `store.timeout_s` (RemoteUnavailable past it)."""

    def __init__(
        self,
        store: RemoteStore,
        path_of: Callable[[str], Path],
        sync: bool = True,
        kv_ttl_s: int = 7 * 86400,
        kv_copy_bytes: int = 0,
        kv_resume: str = "auto",
    ) -> None:
        self.store, self.path_of, self.sync = store, path_of, sync
        self.kv_ttl_s = kv_ttl_s  # a KV block's life in the store since it was last written (`h3d.remote.kv`)
        self.kv_copy_bytes = kv_copy_bytes  # KV written behind waiting for the store, at most (`h3d.remote.copyup`)
        if kv_resume not in KV_RESUME:
            raise ValueError(f"kv_resume: {kv_resume!r} is not one of {', '.join(KV_RESUME)}")
        self.kv_resume = kv_resume  # a session taken over: its KV from the store or computed (`Engine._choose_kv`)
        self.read_bytes_per_s: float | None = None  # the store's reads as measured here (`note_read`)
        self.timeout_s = store.timeout_s
        self._logs: dict[str, _Log] = {}
        self._degraded: str | None = None
        self._failed_at = 0.0  # when the store last failed a call (monotonic)
        self._loop = _new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="h3d-remote", daemon=True)
        self._thread.start()
        self._renewing: asyncio.Task[None] | None = None
        self._pending: dict[str, int] = {}  # sizes `written` told, not yet taken by the store's thread
        self._pending_lock = threading.Lock()
        self._wake_due = False  # the store's thread is to take them

    # ---- the calling threads' side ------------------------------------------------------------

    def note_read(self, nbytes: int, seconds: float) -> None:
        """A read of `nbytes` from the store took `seconds` (one of at least `RATE_MIN_BYTES`
        counts): the store's read rate, a running mean of the last ones."""
        if nbytes < RATE_MIN_BYTES or seconds <= 0:
            return
        rate, last = nbytes / seconds, self.read_bytes_per_s
        self.read_bytes_per_s = rate if last is None else (last + rate) / 2

    def _wait(self, coro: Coroutine[Any, Any, T], grace: float = 1.0) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.timeout_s + grace)
        except TimeoutError as e:
            future.cancel()
            raise RemoteUnavailable(f"remote store: no answer within {self.timeout_s} s") from e

    def start(self) -> str:
        """Connect; in `sync` mode check the store persists every write first (NotDurable).
        Returns what was checked (for the log)."""
        found = self._wait(self._start())
        return found

    async def _start(self) -> str:
        await self.store.ping()
        found = await self.store.check_durable() if self.sync else "not checked (remote_log = async)"
        self._renewing = asyncio.create_task(self._renew_loop())
        return found

    def take(self, session: str) -> int:
        """Take `session`'s lease (Held if another daemon serves it) and start copying its log.
        Returns the bytes of its log the store holds (0 for a new session). While the store is
        down it fails at once (RemoteUnavailable) for `RETRY_S` after each failure, so that a caller
        on the engine thread waits for the timeout at most once in that time."""
        if self._degraded is not None and time.monotonic() - self._failed_at < RETRY_S:
            raise RemoteUnavailable(f"the remote store is unavailable: {self._degraded}")
        try:
            return self._wait(self._take(session), grace=self.timeout_s)
        except RemoteUnavailable as e:
            self._degrade(str(e))
            raise

    async def _take(self, session: str) -> int:
        lease = await self.store.acquire(session)
        try:
            stored = await self.store.log_size(session)
        except BaseException:  # (a failure or a caller that gave up: the lease is not kept)
            await _release_quietly(self.store, lease)
            raise
        self._logs[session] = _Log(lease, self.path_of(session), stored, stored)
        return stored

    def creating(self, session: str) -> None:
        """A new session's log is about to be written (`h3d.store.tokenlog.LogMirror`): take its lease."""
        self.take(session)

    def deleted(self, session: str) -> None:
        """A session was deleted: its log goes from the store too (tried again while the store is
        down), then its local file (which holds a CLOSED record: a daemon stopped before the store's
        log went finds it at its next start, `reconcile`, and deletes that log then)."""
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._delete_until_done(session)))

    async def _delete_until_done(self, session: str) -> None:
        while True:
            try:
                await self._delete(session)
                break
            except Fenced:
                break
            except RemoteError as e:
                self._degrade(str(e))
                await asyncio.sleep(RETRY_S)
        self.path_of(session).unlink(missing_ok=True)

    def adopt(self, session: str) -> bytes | None:
        """A session this daemon does not have: its lease taken (Held if another daemon serves it)
        and its log as the store holds it, to be served from here on; None if the store has none."""
        return self._wait(self._adopt(session), grace=2 * self.timeout_s)

    async def _adopt(self, session: str) -> bytes | None:
        if await self.store.log_bytes(session) is None:
            holder = await self.store.holder(session)
            if holder is not None and not holder.startswith(self.store.owner + " "):
                # (created on another daemon a moment ago: its first bytes are on their way)
                raise Held(f"session {session} is served by another daemon ({holder.split(' ')[0]})", holder)
            return None
        lease = await self.store.acquire(session)
        try:
            data = await self.store.log_bytes(session)  # (read again under the lease: nothing writes it now)
        except BaseException:
            await _release_quietly(self.store, lease)
            raise
        if data is None:  # deleted meanwhile
            await _release_quietly(self.store, lease)
            return None
        self._logs[session] = _Log(lease, self.path_of(session), len(data), len(data))
        return data

    def reconcile(self, paths: list[Path]) -> tuple[list[str], list[str]]:
        """At start, before the local logs are read (`paths`, named `<session>.h3log`): each one's
        lease taken and the file made the store's log where the two differ (the store is the
        truth: another daemon served the session since), or its tail copied where the store lacks
        it (it holds a prefix of the file). The files of sessions another daemon serves now are
        deleted (their archived KV goes with the sweep of blocks without a log). Returns those,
        and those whose file was replaced."""
        gone, replaced = [], []
        for path in paths:
            session = path.name.split(".")[0]
            try:
                self.take(session)
            except Held:
                path.unlink(missing_ok=True)
                gone.append(session)
                continue
            data = self.fetch(session) or b""
            local = path.read_bytes()
            told = parse_log(session, local)
            if told.closed:  # deleted here, and the daemon stopped before the store heard of it
                self.delete(session)
                continue
            local = local[: len(local) - told.truncated_bytes]  # (a torn tail: cut off when the file is read)
            if local.startswith(data):
                self.written(session, len(local))  # (what the store lacks, if anything, copied)
            else:
                replace_file(path, data)
                replaced.append(session)
                log.warning("token log of session %s replaced by the remote store's (%d bytes)", session, len(data))
        return gone, replaced

    def written(self, session: str, size: int) -> None:
        """`session`'s file holds `size` bytes now: copy what the store lacks (returns at once).
        Called for every write of every log (a token, each session, each step): the sizes wait in
        `_pending`, and the store's thread is woken once for all that came meanwhile."""
        with self._pending_lock:
            self._pending[session] = max(size, self._pending.get(session, 0))
            if self._wake_due:
                return
            self._wake_due = True
        self._loop.call_soon_threadsafe(self._take_pending)

    def _take_pending(self) -> None:
        with self._pending_lock:
            pending, self._pending, self._wake_due = self._pending, {}, False
        for session, size in pending.items():
            self._written(session, size)

    def durable(self, session: str, size: int) -> Future[None]:
        """Resolves once the store holds the file's first `size` bytes of `session`'s log; in
        `sync` mode fails with RemoteUnavailable after `timeout_s` (`async`: waits as long as it takes)."""
        future: Future[None] = Future()
        self._loop.call_soon_threadsafe(self._add_waiter, session, size, future)
        return future

    def put_kv(self, items: list[tuple[str, bytes]], ttl_s: int) -> None:
        """Write KV blocks to the store (`RemoteStore.put_kv`); each round trip within the timeout."""
        self._wait(self.store.put_kv(items, ttl_s), grace=_transfer_s(sum(len(v) for _, v in items)))

    def touch_kv(self, keys: list[str], ttl_s: int) -> list[bool]:
        """Which KV blocks the store has, their expiry renewed (`RemoteStore.touch_kv`)."""
        return self._wait(self.store.touch_kv(keys, ttl_s), grace=1.0 + len(keys) / 1e5)

    def put_digests(self, session: str, head: dict[str, object], data: bytes, ttl_s: int) -> None:
        """`RemoteStore.put_digests`, within the timeout and the transfer's allowance."""
        self._wait(self.store.put_digests(session, head, data, ttl_s), grace=_transfer_s(len(data)))

    def get_digests(
        self, session: str, go_on: Callable[[int, float], bool] | None = None
    ) -> tuple[dict[str, Any], bytes] | None:
        """`session`'s digest snapshot in the store (`RemoteStore.digests_head`, then its pieces,
        each within the transfer's allowance for its size), or None. `go_on(bytes, seconds)` is
        told how long the first piece took and may stop the read there (None)."""
        head = self._wait(self.store.digests_head(session))
        if head is None:
            return None
        pieces: list[bytes | None] = []
        for i in range(int(head.get("pieces", 0))):
            t0 = time.perf_counter()
            piece = self._wait(self.store.get_digest_piece(session, i), grace=_transfer_s(DIGEST_PIECE_BYTES))
            if piece is None:
                return None
            pieces.append(piece)
            if i == 0 and go_on is not None and not go_on(len(piece), time.perf_counter() - t0):
                return None
        data = digests_whole(head, pieces)
        return None if data is None else (head, data)

    def soon(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` on the store's thread, not waited for (`h3d.remote.copyup`)."""
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def get_kv(self, keys: list[str]) -> list[bytes | None]:
        """Read KV blocks from the store (`RemoteStore.get_kv`); None where it has none."""
        return self._wait(self.store.get_kv(keys), grace=_transfer_s(len(keys) << 20))

    def fetch(self, session: str) -> bytes | None:
        """The store's log of `session` (None if it has none), read without taking it."""
        return self._wait(self.store.log_bytes(session))

    def holder(self, session: str) -> str | None:
        return self._wait(self.store.holder(session))

    def sessions(self) -> list[str]:
        return self._wait(self.store.sessions())

    def release(self, session: str) -> None:
        """Copy the rest of `session`'s log, then give its lease up: another daemon may take it at
        once. Raises RemoteUnavailable (the lease stays until it expires) if the store lacks bytes."""
        self._wait(self._release(session), grace=2 * self.timeout_s)

    async def _release(self, session: str) -> None:
        entry = self._logs.get(session)
        if entry is None:
            return
        await self._catch_up(session, entry, deadline=time.monotonic() + self.timeout_s)
        if entry.stored < entry.local:
            raise RemoteUnavailable(f"session {session}: the store lacks {entry.local - entry.stored} bytes of its log")
        await self.store.release(entry.lease)
        if entry.task is not None:
            entry.task.cancel()
        self._logs.pop(session, None)  # (only once released: a failure leaves it served and copied here)

    def delete(self, session: str) -> None:
        """Delete `session`'s log from the store (its lease with it)."""
        self._wait(self._delete(session))

    async def _delete(self, session: str) -> None:
        entry = self._logs.get(session)
        if entry is None:
            return
        entry.lost = entry.lost or "deleted"  # (nothing more copied; the lease still renewed until it goes)
        if entry.task is not None:
            entry.task.cancel()
        _fail(entry, RemoteError(f"session {session} was deleted"))
        with contextlib.suppress(Fenced):  # (another daemon holds it now: its log is that daemon's)
            await self.store.delete(entry.lease)
        self._logs.pop(session, None)

    def forget(self, session: str) -> None:
        """Stop copying `session` (its lease left to expire): a session this daemon no longer serves."""
        self._loop.call_soon_threadsafe(self._forget, session)

    def _forget(self, session: str) -> None:
        entry = self._logs.pop(session, None)
        if entry is not None and entry.task is not None:
            entry.task.cancel()

    def _degrade(self, reason: str) -> None:
        if self._degraded is None:
            log.warning("remote tier degraded: %s", reason)
        self._degraded, self._failed_at = reason, time.monotonic()

    def _recovered(self) -> None:
        if self._degraded is not None:
            log.warning("remote tier recovered")
        self._degraded = None

    @property
    def degraded(self) -> str | None:
        """Why the store does not take the copies now (None: it does)."""
        return self._degraded

    def lag_bytes(self) -> int:
        """Bytes of the files the store does not hold yet, all sessions."""
        return sum(max(0, x.local - x.stored) for x in list(self._logs.values()))

    def lost(self) -> dict[str, str]:
        """The sessions whose lease is gone (another daemon took them), with why."""
        return {s: x.lost for s, x in list(self._logs.items()) if x.lost not in (None, "deleted")}

    def close(self) -> None:
        """Copy what the store lacks (within `timeout_s`), give every lease up, stop the thread."""
        with contextlib.suppress(RemoteError):
            self._wait(self._close(), grace=self.timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _close(self) -> None:
        if self._renewing is not None:
            self._renewing.cancel()
        deadline = time.monotonic() + self.timeout_s
        for session, entry in list(self._logs.items()):
            if entry.lost is None:
                await self._catch_up(session, entry, deadline)
            if entry.stored >= entry.local and entry.lost is None:
                with contextlib.suppress(RemoteError):
                    await self.store.release(entry.lease)
            _fail(entry, RemoteUnavailable("the daemon is stopping"))
        self._logs.clear()
        await self.store.close()

    # ---- the store's thread -------------------------------------------------------------------

    def _written(self, session: str, size: int) -> None:
        entry = self._logs.get(session)
        if entry is None:
            return
        entry.local = max(entry.local, size)
        if entry.task is None or entry.task.done():
            entry.task = asyncio.ensure_future(self._copy(session, entry))

    def _add_waiter(self, session: str, size: int, future: Future[None]) -> None:
        entry = self._logs.get(session)
        if entry is None:
            future.set_exception(RemoteError(f"session {session}'s log is not copied to the remote store"))
            return
        if entry.lost is not None:
            future.set_exception(Fenced(entry.lost))
            return
        if entry.stored >= size:
            future.set_result(None)
            return
        entry.waiters.append((size, future))
        if self.sync:
            self._loop.call_later(self.timeout_s, self._expire, future, session)

    def _expire(self, future: Future[None], session: str) -> None:
        if not future.done():
            reason = self._degraded or "the store did not acknowledge in time"
            future.set_exception(RemoteUnavailable(f"session {session}'s log is not in the remote store: {reason}"))

    async def _copy(self, session: str, entry: _Log) -> None:
        """Append what the store lacks until it holds the whole file (retrying while it is down)."""
        while entry.stored < entry.local and entry.lost is None and self._logs.get(session) is entry:
            try:
                await self._append_some(session, entry)
                self._recovered()
            except Fenced as e:
                held = await self._hold_again(session, entry) if e.lease_gone else False
                if held is None:  # (the store is away again: tried later)
                    await asyncio.sleep(RETRY_S)
                elif not held:
                    self._lose(session, entry, e)
                    return
            except RemoteError as e:
                self._degrade(str(e))
                await asyncio.sleep(RETRY_S)

    async def _catch_up(self, session: str, entry: _Log, deadline: float) -> None:
        while entry.stored < entry.local and entry.lost is None and time.monotonic() < deadline:
            try:
                await self._append_some(session, entry)
            except Fenced as e:
                entry.lost = str(e)
                return
            except RemoteError:
                await asyncio.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))

    async def _append_some(self, session: str, entry: _Log) -> None:
        async with entry.lock:  # (the copy task and a release's or a stop's catch-up: one at a time)
            await self._append_locked(session, entry)

    async def _append_locked(self, session: str, entry: _Log) -> None:
        n = min(entry.local - entry.stored, APPEND_MAX_BYTES)
        if n <= 0:
            return
        data = await asyncio.to_thread(_pread, entry.path, entry.stored, n)
        if len(data) < n:
            raise Fenced(f"session {session}: its log file is shorter than what was written ({entry.path})")
        size = await self.store.append(entry.lease, data, at=entry.stored)
        entry.stored = size
        done = [f for s, f in entry.waiters if s <= size]
        entry.waiters = [(s, f) for s, f in entry.waiters if s > size]
        for future in done:
            if not future.done():
                future.set_result(None)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            try:
                await self._renew_all()
            except Exception:  # a bug: logged, and the renewals go on at the next round
                log.exception("remote tier: renewing the leases failed")

    async def _renew_all(self) -> None:
        """Every lease held renewed, in pipelines (`RemoteStore.renew_many`); those found gone
        taken again where no other daemon took them (`_hold_again`), else their sessions lost."""
        entries = [(s, x) for s, x in list(self._logs.items()) if x.lost in (None, "deleted")]
        try:
            held = await self.store.renew_many([x.lease for _, x in entries])
        except RemoteError as e:
            self._degrade(str(e))
            return
        if all(entry.stored >= entry.local for _, entry in entries):
            self._recovered()  # (the store answers, and every log is whole there)
        for (session, entry), ok in zip(entries, held, strict=True):
            if ok or self._logs.get(session) is not entry:
                continue
            again = await self._hold_again(session, entry)
            if again is False:
                self._lose(session, entry, Fenced(f"session {session}: this daemon's lease is gone", lease_gone=True))

    async def _hold_again(self, session: str, entry: _Log) -> bool | None:
        """`entry`'s lease expired (the store was out of reach longer than a lease, or restarted):
        take it again if no other daemon did, and if the store's log is still what this one
        copied (no other daemon wrote it meanwhile); with a new token. -> whether it holds it;
        None if the store did not answer (tried again later)."""
        try:
            lease = await self.store.acquire(session)
        except Held:
            return False
        except RemoteError as e:
            self._degrade(str(e))
            return None
        try:
            size = await self.store.log_size(session)
        except RemoteError as e:
            self._degrade(str(e))
            await _release_quietly(self.store, lease)
            return None
        if size != entry.stored:
            await _release_quietly(self.store, lease)
            return False
        entry.lease = lease
        log.warning("remote tier: session %s: its lease had expired; taken again (token %d)", session, lease.token)
        return True

    def _lose(self, session: str, entry: _Log, error: Fenced) -> None:
        entry.lost = str(error)
        log.error("remote tier: session %s: %s", session, error)
        _fail(entry, error)


async def _release_quietly(store: RemoteStore, lease: Lease) -> None:
    """Give `lease` up, if the store answers (else it expires by itself)."""
    with contextlib.suppress(RemoteError):
        await store.release(lease)


def _transfer_s(nbytes: int) -> float:
    """A bulk transfer's allowance beyond one call's timeout: at 50 MB/s (each round trip of it has
    the timeout of its own)."""
    return 1.0 + nbytes / 50e6


def _fail(entry: _Log, error: Exception) -> None:
    waiters, entry.waiters = entry.waiters, []
    for _, future in waiters:
        if not future.done():
            future.set_exception(error)


def _pread(path: Path, offset: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:  # (uvloop is a dependency; a platform without it runs asyncio's own)
        return asyncio.new_event_loop()
