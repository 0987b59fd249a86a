"""The token log: each session's context, append-only and checksummed — the truth KV is rebuilt from.

One file per session, `<folder>/<session id>.h3log`, a sequence of records:

    b"H3" | kind (1 byte) | payload length (u32 LE) | crc32 of kind+length+payload (u32 LE) | payload

- `META`: a JSON object (policy, sampling defaults, owner, times); each one's keys replace those
  of the ones before, and a key a record leaves out keeps its earlier value.
- `TOKENS`: token ids appended to the context (u32 LE each).
- `CUT`: the context was cut back to a length (u64 LE).
- `CLOSED`: the session was closed (the file is deleted right after; a crash in between leaves it).
- `MESSAGE`: a chat message and its tokens in one record (u32 LE JSON length, the JSON object,
  then the token ids as in `TOKENS`), so that a message never exists without its tokens.

Writes go to the file at once (the OS has them, so a killed process loses nothing it wrote);
`fsync` runs at most every `fsync_interval_ms` for all dirty logs (group commit, `sync_due`) and
whenever a caller asks (`sync`, at the end of every Generate). The daemon's group commit runs
behind (`sync_due(behind=True)`): the dirty logs' descriptors are duplicated and fsynced on the
store's own thread, so the engine thread never waits on the disk for it; a log counts as synced up
to the bytes it held when its fsync began, and only once that fsync returned (`sync` of a log
with a commit in flight fsyncs it again itself rather than trust it). A failed fsync behind is
raised by the next `sync` of that log, on the caller's thread (the end of a Generate fails rather
than report a log durable that may not be). Reading stops at the first torn or corrupt
record and truncates the file there: what follows it was never acknowledged as durable.

Files are created 0600 and a folder it creates 0700, whatever the umask (`h3d.store.files`).

A `mirror` (`LogMirror`; the remote tier's `h3d.remote.logs.RemoteLogs`) is told of each log
before it is created (it may refuse: nothing is created), of each write once the file holds it,
and of each deletion.

Seams (what a test passes in or reads, never a private name): every file system call but reads and
closes goes through `files`, an `h3d.store.files.FileOps` (the real calls by default: a subclass
stands for a short write, a failing or counted fsync); the group commit's time is `clock`'s
(`time.monotonic` by default); `open_sessions` and `unsynced` say what the store holds;
`record` is the record format.

Owner: the files under the folder. Pure Python (no torch).
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from h3d.store.files import FileOps, make_dirs

MAGIC = b"H3"
HEADER = struct.Struct("<2sBII")  # magic, kind, length, crc
META, TOKENS, CUT, CLOSED, MESSAGE = 1, 2, 3, 4, 5
SUFFIX = ".h3log"


class LogMirror(Protocol):
    """A copy of the logs somewhere else, kept up by whoever implements it (the remote tier:
    `h3d.remote.logs.RemoteLogs`): told of each log before it is created (it may refuse: the
    creation fails), of each write once the file holds it (its new size), and of each deletion
    (the file, its CLOSED record written, is left for the mirror to delete once its copy is gone:
    a daemon stopped first finds it at its next start, and deletes the copy then)."""

    def creating(self, session_id: str) -> None: ...

    def written(self, session_id: str, size: int) -> None: ...

    def deleted(self, session_id: str) -> None: ...


@dataclass
class Restored:
    """A session as its log tells it."""

    session_id: str
    meta: dict[str, Any]
    tokens: list[int]
    closed: bool
    truncated_bytes: int  # a torn or corrupt tail that was cut off
    # Chat messages in order: (the message's JSON object, the context's length before its tokens)
    messages: list[tuple[dict[str, Any], int]] = field(default_factory=list)


@dataclass
class _Log:
    fd: int
    size: int  # bytes written
    synced: int = -1  # bytes an fsync that returned covered (the size at open, by default)
    error: OSError | None = None  # a failed fsync behind, raised by the next `sync` of this log

    def __post_init__(self) -> None:
        if self.synced < 0:
            self.synced = self.size

    @property
    def dirty(self) -> bool:
        return self.synced < self.size


@dataclass
class TokenStore:
    """The logs of one folder. `files`: its file system calls; `clock`: seconds, monotonic, that
    `fsync_interval_ms` is measured on. `syncs` counts the group-commit fsyncs (`sync`)."""

    folder: Path
    fsync_interval_ms: float = 50.0
    files: FileOps = field(default_factory=FileOps)
    clock: Callable[[], float] = time.monotonic
    mirror: LogMirror | None = None
    syncs: int = 0
    _logs: dict[str, _Log] = field(default_factory=dict, init=False)
    _last_sync: float = field(default=0.0, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _behind: ThreadPoolExecutor | None = field(default=None, init=False)
    _in_flight: Future[None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        make_dirs(self.folder)
        self._last_sync = self.clock()

    # ---- writing ----------------------------------------------------------------------------

    def create(self, session_id: str, meta: dict[str, Any], tokens: list[int]) -> None:
        """A new session's log: its metadata and first tokens, durable before this returns."""
        self.write_new(session_id, meta, tokens)
        self.open_new(session_id)

    def write_new(
        self, session_id: str, meta: dict[str, Any], tokens: list[int], message: dict[str, Any] | None = None
    ) -> int:
        """`create`'s file, durable when this returns, written from any thread: the logs' writer
        takes it up with `open_new`. Until then it is a session all the same (a start loads it).
        Returns its size in bytes."""
        data = [record(META, json.dumps(meta).encode())]
        if message is not None:
            data.append(_message_record(message, tokens))
        elif tokens:
            data.append(record(TOKENS, _pack(tokens)))
        joined = b"".join(data)
        self._write_file(session_id, joined)
        return len(joined)

    def open_new(self, session_id: str) -> None:
        """Take up a log `write_new` wrote (on the thread that writes the logs)."""
        self._open(session_id, self._path(session_id))

    def fork(self, source: str, session_id: str, meta: dict[str, Any], num_tokens: int) -> Restored:
        """A new session's log holding the first `num_tokens` tokens of `source`'s (a fork), with the
        chat messages among them, and `meta`; durable before this returns, as `create`'s. A cut
        inside a message's tokens is refused (ValueError: a message never exists without its
        tokens). Returns what the new log holds, as `load_all` would read it."""
        if source not in self._logs:
            raise ValueError(f"session {source} has no token log")
        old = read_log(self._path(source))  # every write so far: the OS holds them
        if num_tokens > len(old.tokens):
            raise ValueError(f"session {source} holds {len(old.tokens)} tokens, not {num_tokens}")
        tokens = old.tokens[:num_tokens]
        data, messages, at = [record(META, json.dumps(meta).encode())], [], 0
        for message, start in old.messages:
            if start >= num_tokens:
                break
            end = start + int(message.get("n", 0))
            if end > num_tokens:
                raise ValueError(f"token {num_tokens} is inside a chat message (tokens {start} to {end})")
            if start > at:
                data.append(record(TOKENS, _pack(tokens[at:start])))
            data.append(_message_record(message, tokens[start:end]))
            messages.append((message, start))
            at = end
        if at < num_tokens:
            data.append(record(TOKENS, _pack(tokens[at:])))
        self._create(session_id, b"".join(data))
        return Restored(session_id, meta, tokens, False, 0, messages)

    def _create(self, session_id: str, data: bytes, mirrored: bool = True) -> None:
        self._write_file(session_id, data, mirrored)
        self._open(session_id, self._path(session_id))

    def _write_file(self, session_id: str, data: bytes, mirrored: bool = True) -> None:
        """A new log's file, written and renamed into place durably (its copy told, `mirrored`)."""
        path = self._path(session_id)
        if session_id in self._logs or path.exists():
            raise ValueError(f"session {session_id} already has a token log")
        if mirrored and self.mirror is not None:
            self.mirror.creating(session_id)
        try:
            tmp = path.with_suffix(".tmp")
            files = self.files
            files.unlink(tmp, missing_ok=True)  # a create that failed midway: never acknowledged
            fd = files.create(tmp, os.O_WRONLY)
            try:
                view = memoryview(data)
                while view:
                    view = view[files.write(fd, view) :]
                files.fsync(fd)
            finally:
                os.close(fd)
            files.replace(tmp, path)
            files.fsync_dir(self.folder)
        except BaseException:
            if mirrored and self.mirror is not None:
                self.mirror.deleted(session_id)  # (the copy it had begun: nothing of it is kept)
            raise
        if mirrored and self.mirror is not None:
            self.mirror.written(session_id, len(data))

    def restore(self, session_id: str, data: bytes) -> Restored:
        """A log whose bytes come from elsewhere (the remote store's: a session this daemon takes
        over), written as `create` writes one, the copy not told (it has them). Returns what it holds."""
        restored = parse_log(session_id, data)
        if restored.truncated_bytes:
            raise ValueError(f"session {session_id}'s log is torn after {len(data) - restored.truncated_bytes} bytes")
        old = self._logs.pop(session_id, None)
        if old is not None:
            os.close(old.fd)
        self.files.unlink(self._path(session_id), missing_ok=True)
        self._create(session_id, data, mirrored=False)
        return restored

    def size(self, session_id: str) -> int:
        """The bytes of `session_id`'s log written so far (0 for an unknown one)."""
        log = self._logs.get(session_id)
        return 0 if log is None else log.size

    def path(self, session_id: str) -> Path:
        """`session_id`'s log file."""
        return self._path(session_id)

    def append(self, session_id: str, tokens: list[int]) -> None:
        if tokens:
            self._write(session_id, record(TOKENS, _pack(tokens)))

    def append_message(self, session_id: str, message: dict[str, Any], tokens: list[int]) -> None:
        """A chat message and the tokens it adds to the context, as one record."""
        self._write(session_id, _message_record(message, tokens))

    def set_meta(self, session_id: str, meta: dict[str, Any]) -> None:
        self._write(session_id, record(META, json.dumps(meta).encode()))

    def cut(self, session_id: str, num_tokens: int) -> None:
        self._write(session_id, record(CUT, struct.pack("<Q", num_tokens)))

    def delete(self, session_id: str, mirrored: bool = True) -> None:
        """Forget a closed session: a CLOSED record (durable), then the file goes (and the copy,
        unless not `mirrored`: a session handed to another daemon, whose log lives on there). With
        a mirror, the file stays until the mirror deleted the copy (`LogMirror.deleted`): a copy
        the mirror could not delete before the daemon stopped is not forgotten."""
        log = self._logs.pop(session_id, None)
        if log is None:
            return
        try:
            if mirrored:  # (a handed-over log is not closed: at a restart its CLOSED record would delete the copy)
                self.files.write(log.fd, record(CLOSED, b""))
                self.files.fsync(log.fd)
        finally:
            os.close(log.fd)
        if mirrored and self.mirror is not None:
            self.mirror.deleted(session_id)  # (which deletes the file once the copy is gone)
            return
        self.files.unlink(self._path(session_id), missing_ok=True)
        self.files.fsync_dir(self.folder)

    def sync(self, session_id: str | None = None) -> None:
        """fsync one session's log (or every dirty one) now, on this thread; raises what an fsync
        behind of that log raised."""
        logs = [self._logs[session_id]] if session_id in self._logs else []
        if session_id is None:
            logs = list(self._logs.values())
        failed: OSError | None = None
        for log in logs:
            error, log.error = log.error, None
            if error is not None:
                failed = failed or error
            if log.dirty:
                self._fsync(log, log.fd, log.size)
        if session_id is None:
            self._last_sync = self.clock()
        if failed is not None:
            raise failed

    def sync_due(self, behind: bool = False) -> None:
        """Group commit: fsync the dirty logs if `fsync_interval_ms` has passed since the last time;
        `behind`: on the store's thread, without waiting (one commit in flight at a time: while
        one is, this does nothing, and the next call after it returned is due at once)."""
        if (self.clock() - self._last_sync) * 1000 < self.fsync_interval_ms:
            return
        if not behind:
            self.sync()
            return
        if self._in_flight is not None and not self._in_flight.done():
            return
        work = [(log, os.dup(log.fd), log.size) for log in self._logs.values() if log.dirty]
        self._last_sync = self.clock()
        if work:
            if self._behind is None:
                self._behind = ThreadPoolExecutor(1, thread_name_prefix="h3d-log-sync")
            self._in_flight = self._behind.submit(self._commit_behind, work)

    def sync_behind(self, session_id: str) -> Future[None]:
        """fsync one session's log on the store's thread, after any commit in flight there (the end
        of a Generate in the daemon: the engine's thread does not wait for the disk). The future
        fails with what that fsync, or an earlier one behind of this log, raised; it is done at
        once where the log is synced already."""
        log = self._logs.get(session_id)
        if log is None or (not log.dirty and log.error is None):
            done: Future[None] = Future()
            done.set_result(None)
            return done
        if self._behind is None:
            self._behind = ThreadPoolExecutor(1, thread_name_prefix="h3d-log-sync")
        return self._behind.submit(self._sync_one, log, os.dup(log.fd), log.size)

    def _sync_one(self, log: _Log, fd: int, size: int) -> None:
        try:
            error, log.error = log.error, None
            if error is not None:
                raise error
            if log.synced < size:  # (a commit in flight before it may have covered it)
                self._fsync(log, fd, size)
        finally:
            os.close(fd)

    def _commit_behind(self, work: list[tuple[_Log, int, int]]) -> None:
        for log, fd, size in work:
            try:
                self._fsync(log, fd, size)
            except OSError as exc:
                log.error = exc
            finally:
                os.close(fd)

    def _fsync(self, log: _Log, fd: int, size: int) -> None:
        """fsync `fd` (the log's, or a duplicate of it); the log is then synced up to `size` bytes."""
        self.files.fsync(fd)
        with self._lock:
            log.synced = max(log.synced, size)
            self.syncs += 1

    def settle(self) -> None:
        """Wait for the group commit behind in flight, if any (its failures stay for `sync`)."""
        if self._in_flight is not None:
            self._in_flight.result()

    def close(self) -> None:
        self.settle()
        if self._behind is not None:
            self._behind.shutdown(wait=True)
            self._behind = None
        self.sync()
        for log in self._logs.values():
            os.close(log.fd)
        self._logs.clear()

    def open_sessions(self) -> frozenset[str]:
        """The sessions whose logs this store holds open (created, or restored by `load_all`)."""
        return frozenset(self._logs)

    def unsynced(self, session_id: str) -> bool:
        """Whether `session_id`'s log has writes no fsync has covered yet (False for an unknown one)."""
        log = self._logs.get(session_id)
        return log is not None and log.dirty

    # ---- reading ----------------------------------------------------------------------------

    def load_all(self) -> list[Restored]:
        """Every session log in the folder, oldest first (by creation time); torn tails cut off,
        logs of closed sessions deleted. The logs stay open for appending."""
        out = []
        files = self.files
        for tmp in self.folder.glob("*.tmp"):
            files.unlink(tmp)  # a create that never finished: its session was never acknowledged
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            restored = read_log(path)
            if restored.closed:
                files.unlink(path)
                continue
            if restored.truncated_bytes:
                fd = files.open(path, os.O_WRONLY)
                try:
                    files.truncate(fd, path.stat().st_size - restored.truncated_bytes)
                    files.fsync(fd)
                finally:
                    os.close(fd)
            self._open(restored.session_id, path)
            out.append(restored)
        return sorted(out, key=lambda r: (_created_at(r.meta), r.session_id))

    # ---- internals --------------------------------------------------------------------------

    def _path(self, session_id: str) -> Path:
        if not session_id or not all(c.isalnum() or c in "-_" for c in session_id):
            raise ValueError(f"not a session id usable as a file name: {session_id!r}")
        return self.folder / f"{session_id}{SUFFIX}"

    def _open(self, session_id: str, path: Path) -> None:
        old = self._logs.pop(session_id, None)
        if old is not None:
            os.close(old.fd)
        fd = self.files.open(path, os.O_WRONLY | os.O_APPEND)
        self._logs[session_id] = _Log(fd=fd, size=os.fstat(fd).st_size)

    def _write(self, session_id: str, data: bytes) -> None:
        log = self._logs[session_id]
        written = self.files.write(log.fd, data)
        if written != len(data):  # a short write (full disk): never leave half a record behind
            self.files.truncate(log.fd, log.size)
            raise OSError(28, "short write to the token log (disk full?)")
        log.size += written
        if self.mirror is not None:
            self.mirror.written(session_id, log.size)


def read_log(path: Path) -> Restored:
    return parse_log(path.name[: -len(SUFFIX)], path.read_bytes())


def parse_log(session_id: str, data: bytes) -> Restored:
    """A log's records (`data`, as the file or a remote store holds them) -> the session they tell;
    reading stops at the first torn or corrupt record (`Restored.truncated_bytes` after it)."""
    meta: dict[str, Any] = {}
    tokens: list[int] = []
    closed = False
    messages: list[tuple[dict[str, Any], int]] = []
    pos = 0
    while pos + HEADER.size <= len(data):
        magic, kind, length, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + length
        if magic != MAGIC or end > len(data):
            break
        payload = data[pos + HEADER.size : end]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]) + struct.pack("<I", length))) != crc:
            break
        if kind == META:
            try:
                value = json.loads(payload)
            except (json.JSONDecodeError, UnicodeDecodeError):
                break
            if not isinstance(value, dict):
                break
            meta.update(value)
        elif kind == TOKENS and length % 4 == 0:
            tokens.extend(struct.unpack(f"<{length // 4}I", payload))
        elif kind == MESSAGE and length >= 4:
            message = _message(payload)
            if message is None:
                break
            messages.append((message[0], len(tokens)))
            tokens.extend(message[1])
        elif kind == CUT and length == 8:
            cut = struct.unpack("<Q", payload)[0]
            del tokens[cut:]
            messages = [(m, at) for m, at in messages if at < cut]
        elif kind == CLOSED and length == 0:
            closed = True
        else:
            break  # an unknown kind, or a payload of the wrong size: not ours
        pos = end
    return Restored(session_id, meta, tokens, closed, len(data) - pos, messages)


def _message(payload: bytes) -> tuple[dict[str, Any], tuple[int, ...]] | None:
    (n,) = struct.unpack_from("<I", payload)
    if 4 + n > len(payload) or (len(payload) - 4 - n) % 4:
        return None
    try:
        value = json.loads(payload[4 : 4 + n])
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    rest = payload[4 + n :]
    return value, struct.unpack(f"<{len(rest) // 4}I", rest)


def _created_at(meta: dict[str, Any]) -> float:
    value = meta.get("created_at")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def record(kind: int, payload: bytes) -> bytes:
    """One record of `kind` (META, TOKENS, ...) framing `payload`, as the log holds it (module docstring)."""
    crc = zlib.crc32(payload, zlib.crc32(bytes([kind]) + struct.pack("<I", len(payload))))
    return HEADER.pack(MAGIC, kind, len(payload), crc) + payload


def _pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _message_record(message: dict[str, Any], tokens: list[int]) -> bytes:
    """A chat message and the tokens it adds to the context, as one record."""
    head = json.dumps(message).encode()
    return record(MESSAGE, struct.pack("<I", len(head)) + head + _pack(tokens))
