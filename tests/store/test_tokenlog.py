"""The token log (h3d.store.tokenlog): a session's tokens and metadata survive a reopen exactly; a torn
or corrupt tail is cut off at the last whole record and never yields tokens that were not written;
closed and unfinished sessions are cleaned up; fsync runs as the group-commit rules say; a short write
leaves the file as it was."""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h3d.store import tokenlog
from h3d.store.files import FileOps
from h3d.store.tokenlog import CLOSED, CUT, HEADER, META, SUFFIX, TOKENS, TokenStore, read_log, record

U32_MAX = 2**32 - 1
NEVER = 1e15  # an fsync interval (ms) longer than any machine's uptime: sync_due() never fires on its own


# ---- helpers --------------------------------------------------------------------------------------


class NoFsync(FileOps):
    """Skips the real fsyncs, for tests that write hundreds of logs: what they check is the bytes, not
    durability (which a test cannot observe without a crash)."""

    def fsync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: Path) -> None:
        pass


NO_FSYNC = NoFsync()
REAL = FileOps()


@dataclass
class State:
    """What the log says once it is read up to `end` bytes (a record boundary)."""

    end: int
    tokens: list[int]
    meta: dict[str, Any]


Op = tuple[str, Any]  # ("append", [tokens]) | ("cut", n) | ("meta", {..}) | ("reopen", None)


def log_path(folder: Path, sid: str) -> Path:
    return folder / f"{sid}{SUFFIX}"


def write_log(
    folder: Path, sid: str, meta: dict[str, Any], first: list[int], ops: list[Op], files: FileOps = REAL
) -> list[State]:
    """Write a log through the store; return the state at every record boundary, in order (the first
    one is the empty file). Cuts are given as lengths ≤ the current length."""
    store = TokenStore(folder, fsync_interval_ms=NEVER, files=files)
    store.create(sid, meta, first)
    path = log_path(folder, sid)
    states = [State(0, [], {}), State(len(record(META, json.dumps(meta).encode())), [], dict(meta))]
    if first:
        states.append(State(path.stat().st_size, list(first), dict(meta)))
    assert states[-1].end == path.stat().st_size
    tokens, cur = list(first), dict(meta)
    for kind, arg in ops:
        before = path.stat().st_size
        if kind == "append":
            store.append(sid, arg)
            tokens += arg
        elif kind == "cut":
            assert arg <= len(tokens)
            store.cut(sid, arg)
            del tokens[arg:]
        elif kind == "meta":
            store.set_meta(sid, arg)
            cur = {**cur, **arg}  # each record's keys replace the earlier ones'; the rest stay
        else:
            raise AssertionError(kind)
        if path.stat().st_size != before:  # an empty append writes nothing
            states.append(State(path.stat().st_size, list(tokens), dict(cur)))
    store.close()
    assert states[-1].end == path.stat().st_size
    return states


def state_at(states: list[State], offset: int) -> State:
    """The state of the longest whole-record prefix of the first `offset` bytes."""
    return [s for s in states if s.end <= offset][-1]


def reopen(folder: Path, files: FileOps = REAL) -> tuple[TokenStore, list[tokenlog.Restored]]:
    store = TokenStore(folder, fsync_interval_ms=NEVER, files=files)
    return store, store.load_all()


def only(restored: list[tokenlog.Restored], sid: str) -> tokenlog.Restored:
    assert [r.session_id for r in restored] == [sid]
    return restored[0]


META0 = {"created_at": 1000.5, "policy": "hbf", "owner": "alice"}
FIXED_OPS: list[Op] = [
    ("append", [1, 2, 3]),
    ("append", [U32_MAX, 0]),
    ("meta", {"created_at": 1000.5, "policy": "lru", "owner": "alice"}),
    ("append", [7]),
    ("cut", 4),
    ("append", [8, 9, 10, 11]),
    ("cut", 0),
    ("append", [12, 13]),
    ("meta", {"created_at": 1000.5, "policy": "lru", "owner": "bob", "hbf": {"window_tokens": 64}}),
]

token = st.integers(min_value=0, max_value=U32_MAX)
metas = st.fixed_dictionaries(
    {"created_at": st.floats(allow_nan=False, allow_infinity=False), "owner": st.text(max_size=6)},
    optional={"n": st.integers(min_value=-(2**63), max_value=2**63)},
)
raw_ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.lists(token, max_size=12)),
        st.tuples(st.just("cut"), st.integers(min_value=0, max_value=10_000)),  # taken modulo len + 1
        st.tuples(st.just("meta"), metas),
    ),
    max_size=12,
)


def concrete(first: list[int], ops: list[Op]) -> list[Op]:
    """Turn the raw cut arguments into lengths ≤ the current length."""
    out: list[Op] = []
    n = len(first)
    for kind, arg in ops:
        if kind == "cut":
            arg = arg % (n + 1)
            n = arg
        elif kind == "append":
            n += len(arg)
        out.append((kind, arg))
    return out


# ---- 1. round trip -------------------------------------------------------------------------------


def test_round_trip_tokens_and_last_meta(tmp_path: Path) -> None:
    store = TokenStore(tmp_path, fsync_interval_ms=NEVER)
    store.create("s1", {"created_at": 5.0, "policy": "hbf"}, [100, 101])
    store.append("s1", [1, 2, 3])
    store.append("s1", [])  # nothing
    store.append("s1", [0, U32_MAX])
    store.set_meta("s1", {"created_at": 5.0, "policy": "lru", "v": 1})
    store.set_meta("s1", {"created_at": 5.0, "policy": "window", "v": 2, "nested": {"a": [1, 2.5, None]}})
    store.cut("s1", 3)
    store.append("s1", [42, 43])
    store.close()

    restored = only(TokenStore(tmp_path).load_all(), "s1")
    assert restored.tokens == [100, 101, 1, 42, 43]
    assert restored.meta == {"created_at": 5.0, "policy": "window", "v": 2, "nested": {"a": [1, 2.5, None]}}
    assert restored.closed is False
    assert restored.truncated_bytes == 0


def test_round_trip_without_first_tokens(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create("empty", {"created_at": 1.0}, [])
    store.close()
    assert log_path(tmp_path, "empty").stat().st_size == len(record(META, json.dumps({"created_at": 1.0}).encode()))
    restored = only(TokenStore(tmp_path).load_all(), "empty")
    assert (restored.tokens, restored.meta, restored.truncated_bytes) == ([], {"created_at": 1.0}, 0)


def test_sessions_come_back_ordered_by_created_at(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    # names in an order unlike the creation times; the last meta decides ("z" moves to the front)
    store.create("a", {"created_at": 30.0}, [1])
    store.create("b", {"created_at": 10.0}, [2])
    store.create("c", {"created_at": 20.0}, [3])
    store.create("z", {"created_at": 99.0}, [4])
    store.create("y", {"created_at": 20.0}, [5])  # ties: by session id
    store.set_meta("z", {"created_at": 1.0})
    store.close()
    restored = TokenStore(tmp_path).load_all()
    assert [(r.session_id, r.tokens) for r in restored] == [("z", [4]), ("b", [2]), ("c", [3]), ("y", [5]), ("a", [1])]


def test_reopened_store_keeps_appending(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create("s", {"created_at": 1.0}, [1, 2])
    store.close()
    store, restored = reopen(tmp_path)
    assert only(restored, "s").tokens == [1, 2]
    store.append("s", [3])
    store.cut("s", 1)
    store.append("s", [4])
    store.close()
    assert only(reopen(tmp_path)[1], "s").tokens == [1, 4]


def test_unflushed_writes_are_in_the_file_at_once(tmp_path: Path) -> None:
    """Writes go to the OS at once: another reader sees them without a sync or close."""
    store = TokenStore(tmp_path, fsync_interval_ms=NEVER)
    store.create("s", {"created_at": 1.0}, [1])
    store.append("s", [2, 3])
    store.cut("s", 2)
    restored = read_log(log_path(tmp_path, "s"))
    assert (restored.tokens, restored.truncated_bytes) == ([1, 2], 0)
    store.close()


def test_record_layout_matches_the_docstring(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create("s", {"k": 1}, [1, U32_MAX])
    store.cut("s", 1)
    store.close()
    data = log_path(tmp_path, "s").read_bytes()
    payloads = [b'{"k": 1}', struct.pack("<2I", 1, U32_MAX), struct.pack("<Q", 1)]
    pos = 0
    for kind, payload in zip([META, TOKENS, CUT], payloads, strict=True):
        magic, k, length, crc = HEADER.unpack_from(data, pos)
        assert (magic, k, length) == (b"H3", kind, len(payload))
        assert data[pos + HEADER.size : pos + HEADER.size + length] == payload
        assert crc == zlib.crc32(bytes([kind]) + struct.pack("<I", length) + payload)
        pos += HEADER.size + length
    assert pos == len(data)


# ---- 2. random operations against a model --------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    first=st.lists(token, max_size=8),
    meta=metas,
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.lists(token, max_size=12)),
            st.tuples(st.just("cut"), st.integers(min_value=0, max_value=10_000)),
            st.tuples(st.just("meta"), metas),
            st.tuples(st.just("reopen"), st.none()),
        ),
        max_size=20,
    ),
)
def test_random_operations_match_a_model(first: list[int], meta: dict[str, Any], ops: list[Op]) -> None:
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        store = TokenStore(folder, fsync_interval_ms=NEVER, files=NO_FSYNC)
        store.create("s", meta, first)
        model, last_meta = list(first), meta
        for kind, arg in ops:
            if kind == "append":
                store.append("s", arg)
                model += arg
            elif kind == "cut":
                n = arg % (len(model) + 1)
                store.cut("s", n)
                del model[n:]
            elif kind == "meta":
                store.set_meta("s", arg)
                last_meta = {**last_meta, **arg}  # each record's keys replace the earlier ones'; the rest stay
            else:  # a restart in the middle: the reopened store carries on
                store.close()
                store, restored = reopen(folder, NO_FSYNC)
                assert only(restored, "s").tokens == model
        store.close()
        restored_one = only(TokenStore(folder, files=NO_FSYNC).load_all(), "s")
        assert restored_one.tokens == model
        assert restored_one.meta == last_meta
        assert restored_one.truncated_bytes == 0
        assert not restored_one.closed


# ---- 3. torn tail --------------------------------------------------------------------------------


def check_torn(folder: Path, states: list[State], data: bytes, offset: int, files: FileOps, sid: str = "s") -> None:
    """The first `offset` bytes of a log: read_log gives the last whole record's state; load_all cuts
    the file there on disk, and a later append lands right after it."""
    sub = folder / "torn"  # one folder for every case (creating and removing folders is slow)
    sub.mkdir(exist_ok=True)
    path = log_path(sub, sid)
    path.write_bytes(data[:offset])
    want = state_at(states, offset)

    r = read_log(path)
    assert (r.session_id, r.tokens, r.meta, r.closed) == (sid, want.tokens, want.meta, False)
    assert r.truncated_bytes == offset - want.end

    store, restored = reopen(sub, files)
    r2 = only(restored, sid)
    assert (r2.tokens, r2.meta, r2.truncated_bytes) == (want.tokens, want.meta, offset - want.end)
    assert path.stat().st_size == want.end
    assert path.read_bytes() == data[: want.end]
    store.append(sid, [77, U32_MAX])
    store.close()
    after = read_log(path)
    assert (after.tokens, after.meta, after.truncated_bytes) == ([*want.tokens, 77, U32_MAX], want.meta, 0)
    assert path.stat().st_size == want.end + HEADER.size + 8


def test_torn_tail_at_every_offset(tmp_path: Path) -> None:
    states = write_log(tmp_path, "s", META0, [5, 6], FIXED_OPS)
    data = log_path(tmp_path, "s").read_bytes()
    assert len(states) == 3 + len(FIXED_OPS)  # every op wrote one record
    for offset in range(len(data) + 1):
        check_torn(tmp_path, states, data, offset, NO_FSYNC)


@settings(max_examples=60, deadline=None)
@given(first=st.lists(token, max_size=6), meta=metas, ops=raw_ops, where=st.floats(min_value=0.0, max_value=1.0))
def test_torn_tail_random_log(first: list[int], meta: dict[str, Any], ops: list[Op], where: float) -> None:
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        states = write_log(folder, "s", meta, first, concrete(first, ops), NO_FSYNC)
        data = log_path(folder, "s").read_bytes()
        check_torn(folder, states, data, round(where * len(data)), NO_FSYNC)


# ---- 4. corruption -------------------------------------------------------------------------------


def check_corrupt(
    folder: Path, states: list[State], data: bytes, pos: int, mask: int, with_store: bool, files: FileOps
) -> None:
    """Byte `pos` xor `mask`: reading stops at the start of the record that holds it."""
    i = max(k for k, s in enumerate(states) if s.end <= pos)  # the record starts at states[i].end
    want = states[i]
    bad = bytearray(data)
    bad[pos] ^= mask
    sub = folder / "bad"
    sub.mkdir(exist_ok=True)
    path = log_path(sub, "s")
    path.write_bytes(bytes(bad))
    r = read_log(path)
    assert (r.tokens, r.meta, r.closed) == (want.tokens, want.meta, False), (pos, mask)
    assert r.truncated_bytes == len(data) - want.end, (pos, mask)
    if with_store:
        store, restored = reopen(sub, files)
        assert only(restored, "s").tokens == want.tokens
        assert path.read_bytes() == data[: want.end]
        store.append("s", [9])
        store.close()
        assert read_log(path).tokens == [*want.tokens, 9]


def test_corrupt_byte_anywhere(tmp_path: Path) -> None:
    states = write_log(tmp_path, "s", META0, [5, 6], FIXED_OPS)
    data = log_path(tmp_path, "s").read_bytes()
    starts = {s.end for s in states}
    for pos in range(len(data)):
        mask = (0xFF, 0x01, 0x80, 0x5A)[pos % 4]  # every byte flipped, in a few ways
        check_corrupt(tmp_path, states, data, pos, mask, pos in starts or pos % 5 == 0, NO_FSYNC)


@settings(max_examples=60, deadline=None)
@given(
    first=st.lists(token, max_size=6),
    meta=metas,
    ops=raw_ops,
    where=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    mask=st.integers(min_value=1, max_value=255),
)
def test_corrupt_byte_random_log(
    first: list[int], meta: dict[str, Any], ops: list[Op], where: float, mask: int
) -> None:
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        states = write_log(folder, "s", meta, first, concrete(first, ops), NO_FSYNC)
        data = log_path(folder, "s").read_bytes()
        check_corrupt(folder, states, data, int(where * len(data)), mask, True, NO_FSYNC)


def test_garbage_after_the_last_record_is_cut(tmp_path: Path) -> None:
    states = write_log(tmp_path, "s", META0, [5], [("append", [6])])
    path = log_path(tmp_path, "s")
    good = path.read_bytes()
    for junk in (b"\x00" * 40, b"H3", b"H3\x02\xff\xff\xff\xff", record(TOKENS, b"\x01\x00\x00\x00")[:-1] + b"\x02"):
        path.write_bytes(good + junk)
        r = read_log(path)
        assert (r.tokens, r.truncated_bytes) == (states[-1].tokens, len(junk))


# ---- 5. delete and CLOSED ------------------------------------------------------------------------


def test_delete_removes_the_file(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create("gone", {"created_at": 1.0}, [1, 2])
    store.create("kept", {"created_at": 2.0}, [3])
    store.append("gone", [4])
    store.delete("gone")
    assert not log_path(tmp_path, "gone").exists()
    store.delete("gone")  # twice: nothing happens
    store.delete("never-was")
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.h3log"]
    assert only(TokenStore(tmp_path).load_all(), "kept").tokens == [3]


def test_crash_between_closed_record_and_unlink(tmp_path: Path) -> None:
    """A log that ends in CLOSED (the unlink never happened) is not restored, and load_all removes it."""
    store = TokenStore(tmp_path)
    store.create("dead", {"created_at": 1.0}, [1, 2])
    store.append("dead", [3])
    store.create("alive", {"created_at": 2.0}, [4])
    store.close()
    path = log_path(tmp_path, "dead")
    path.write_bytes(path.read_bytes() + record(CLOSED, b""))

    r = read_log(path)
    assert (r.closed, r.tokens, r.truncated_bytes) == (True, [1, 2, 3], 0)

    store2 = TokenStore(tmp_path)
    assert [r.session_id for r in store2.load_all()] == ["alive"]
    assert not path.exists()
    assert "dead" not in store2.open_sessions()
    store2.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alive.h3log"]


def test_torn_closed_record_keeps_the_session(tmp_path: Path) -> None:
    """A CLOSED record that did not make it whole: the close was never durable, the session stays."""
    write_log(tmp_path, "s", META0, [1], [])
    path = log_path(tmp_path, "s")
    closed = record(CLOSED, b"")
    path.write_bytes(path.read_bytes() + closed[:-1])
    store, restored = reopen(tmp_path)
    r = only(restored, "s")
    assert (r.tokens, r.closed, r.truncated_bytes) == ([1], False, len(closed) - 1)
    store.close()
    assert path.exists()


# ---- 6. unfinished create ------------------------------------------------------------------------


def test_leftover_tmp_file_is_removed(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create("real", {"created_at": 1.0}, [1])
    store.close()
    # an unfinished create, complete content and all: it was never acknowledged
    (tmp_path / "half.tmp").write_bytes(record(META, b'{"created_at": 0.5}') + record(TOKENS, struct.pack("<I", 9)))
    (tmp_path / "real.tmp").write_bytes(b"H3")  # a second create of an existing id that never finished
    store2 = TokenStore(tmp_path)
    restored = store2.load_all()
    assert [(r.session_id, r.tokens) for r in restored] == [("real", [1])]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real.h3log"]
    store2.close()


# ---- 7. session ids ------------------------------------------------------------------------------


@pytest.mark.parametrize("sid", ["../x", "", "a/b", "/abs", ".", "..", "a.b", "a b", "x\x00", "a\\b"])
def test_unsafe_session_ids_are_refused(tmp_path: Path, sid: str) -> None:
    folder = tmp_path / "logs"
    store = TokenStore(folder)
    with pytest.raises(ValueError):
        store.create(sid, {"created_at": 1.0}, [1])
    assert list(folder.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]
    assert store.open_sessions() == frozenset()


@pytest.mark.parametrize("sid", ["abc", "A-1_b", "0", "x" * 100])
def test_safe_session_ids_are_accepted(tmp_path: Path, sid: str) -> None:
    store = TokenStore(tmp_path)
    store.create(sid, {"created_at": 1.0}, [1])
    store.close()
    assert only(TokenStore(tmp_path).load_all(), sid).tokens == [1]


# ---- 8. group commit -----------------------------------------------------------------------------


class CountedFsyncs(FileOps):
    """Records the file each fsync was called on, by inode (the call still happens)."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def fsync(self, fd: int) -> None:
        self.calls.append(os.fstat(fd).st_ino)
        super().fsync(fd)


def inode(folder: Path, sid: str) -> int:
    return log_path(folder, sid).stat().st_ino


def test_sync_due_with_zero_interval_syncs_dirty_logs_only(tmp_path: Path) -> None:
    counted = CountedFsyncs()
    fsyncs = counted.calls
    store = TokenStore(tmp_path, fsync_interval_ms=0, files=counted)
    store.create("a", {"created_at": 1.0}, [1])
    store.create("b", {"created_at": 2.0}, [2])
    a, b = inode(tmp_path, "a"), inode(tmp_path, "b")
    fsyncs.clear()  # create's own fsyncs (the file, the folder) are not group commits
    assert store.syncs == 0

    store.sync_due()  # created logs are durable already: nothing dirty
    assert (store.syncs, fsyncs) == (0, [])

    store.append("a", [3])
    store.sync_due()
    assert (store.syncs, fsyncs) == (1, [a])
    store.sync_due()  # clean again: no second fsync
    assert (store.syncs, fsyncs) == (1, [a])

    store.append("a", [4])
    store.set_meta("b", {"created_at": 2.0, "x": 1})
    store.sync_due()
    assert store.syncs == 3 and sorted(fsyncs) == sorted([a, a, b])

    store.cut("b", 0)
    store.close()  # close syncs what is dirty
    assert store.syncs == 4 and fsyncs[-1] == b


def test_sync_due_with_huge_interval_waits_for_explicit_sync(tmp_path: Path) -> None:
    counted = CountedFsyncs()
    fsyncs = counted.calls
    store = TokenStore(tmp_path, fsync_interval_ms=NEVER, files=counted)
    store.create("a", {"created_at": 1.0}, [1])
    store.create("b", {"created_at": 2.0}, [2])
    a, b = inode(tmp_path, "a"), inode(tmp_path, "b")
    fsyncs.clear()
    store.append("a", [3])
    store.append("b", [4])
    for _ in range(3):
        store.sync_due()
    assert (store.syncs, fsyncs) == (0, [])
    assert store.unsynced("a") and store.unsynced("b")

    store.sync("a")  # one session
    assert (store.syncs, fsyncs) == (1, [a])
    assert not store.unsynced("a") and store.unsynced("b")
    store.sync("a")  # clean: nothing
    store.sync("nobody")  # unknown: nothing
    assert (store.syncs, fsyncs) == (1, [a])

    store.sync()  # every dirty one
    assert (store.syncs, fsyncs) == (2, [a, b])
    store.sync_due()
    store.sync()
    assert (store.syncs, fsyncs) == (2, [a, b])
    store.close()
    assert (store.syncs, fsyncs) == (2, [a, b])


def test_sync_due_fires_once_the_interval_has_passed(tmp_path: Path) -> None:
    clock = [10_000.0]
    store = TokenStore(tmp_path, fsync_interval_ms=500, clock=lambda: clock[0])
    store.create("a", {"created_at": 1.0}, [1])
    store.sync()  # the last group commit: t = 10 000 s
    store.append("a", [2])
    clock[0] += 0.499
    store.sync_due()
    assert store.syncs == 0
    clock[0] += 0.001
    store.sync_due()
    assert store.syncs == 1
    store.append("a", [3])
    clock[0] += 0.2
    store.sync_due()
    assert store.syncs == 1
    clock[0] += 0.3
    store.sync_due()
    assert store.syncs == 2
    store.close()


# ---- 9. short write ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["append", "meta", "cut"])
@pytest.mark.parametrize("keep", ["one", "half", "all_but_one"])
def test_short_write_leaves_the_file_as_it_was(tmp_path: Path, kind: str, keep: str) -> None:
    path = log_path(tmp_path, "s")
    shorted: list[int] = []
    armed = [False]

    class ShortWrite(FileOps):
        """Once armed, the first write to the log writes only part of the data (a full disk)."""

        def write(self, fd: int, data: bytes | memoryview) -> int:
            if armed[0] and not shorted and os.path.samestat(os.fstat(fd), path.stat()):
                shorted.append(len(data))
                n = {"one": 1, "half": len(data) // 2, "all_but_one": len(data) - 1}[keep]
                return super().write(fd, data[:n])
            return super().write(fd, data)

    store = TokenStore(tmp_path, fsync_interval_ms=NEVER, files=ShortWrite())
    store.create("s", {"created_at": 1.0}, [1, 2, 3])
    store.append("s", [4])
    before = path.read_bytes()
    armed[0] = True
    with pytest.raises(OSError):
        if kind == "append":
            store.append("s", [5, 6, 7])
        elif kind == "meta":
            store.set_meta("s", {"created_at": 1.0, "lost": True})
        else:
            store.cut("s", 1)
    assert shorted, "the write was not attempted"
    assert path.read_bytes() == before
    r = read_log(path)
    assert (r.tokens, r.meta, r.truncated_bytes) == ([1, 2, 3, 4], {"created_at": 1.0}, 0)

    # the store carries on: later writes land right after the last good record
    store.append("s", [8])
    store.cut("s", 2)
    store.append("s", [9])
    store.set_meta("s", {"created_at": 1.0, "after": 1})
    store.close()
    r = only(TokenStore(tmp_path).load_all(), "s")
    assert (r.tokens, r.meta, r.truncated_bytes) == ([1, 2, 9], {"created_at": 1.0, "after": 1}, 0)


def test_out_of_range_token_writes_nothing(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create("s", {"created_at": 1.0}, [1])
    path = log_path(tmp_path, "s")
    before = path.read_bytes()
    for bad in ([2**32], [-1], [1, 2, 2**40]):
        with pytest.raises(struct.error):
            store.append("s", bad)
    assert path.read_bytes() == before
    store.close()
    assert only(TokenStore(tmp_path).load_all(), "s").tokens == [1]


# ---- records that are valid on the wire but not ours; descriptors ----------------------------------


@pytest.mark.parametrize(
    "bad",
    [record(TOKENS, b"\x01\x02\x03"), record(TOKENS, b"\x01\x00\x00\x00\x02"), record(CUT, b"\x01")],
    ids=["tokens-3-bytes", "tokens-5-bytes", "cut-1-byte"],
)
def test_malformed_but_checksummed_record_stops_reading(tmp_path: Path, bad: bytes) -> None:
    """ "Reading stops at the first torn or corrupt record": a TOKENS payload that is not a multiple of
    4 bytes, or a CUT payload that is not 8, is corrupt even though its CRC matches."""
    write_log(tmp_path, "s", META0, [1, 2], [])
    path = log_path(tmp_path, "s")
    path.write_bytes(path.read_bytes() + bad)
    r = read_log(path)
    assert (r.tokens, r.truncated_bytes) == ([1, 2], len(bad))


@pytest.mark.parametrize(
    "meta_json",
    [b'{"created_at": "2024-01-01T00:00:00"}', b'{"created_at": null}', b"[1]", b"null"],
    ids=["iso-string", "null-created-at", "list", "null"],
)
def test_one_odd_meta_does_not_stop_every_restore(tmp_path: Path, meta_json: bytes) -> None:
    """One log with an odd META (a created_at that is not a number, or not an object at all) must not
    stop the other sessions from coming back."""
    write_log(tmp_path, "good", {"created_at": 1.0}, [1], [])
    write_log(tmp_path, "odd", {"created_at": 2.0}, [2], [])
    path = log_path(tmp_path, "odd")
    path.write_bytes(path.read_bytes() + record(META, meta_json))
    store, restored = reopen(tmp_path)
    store.close()
    assert "good" in [r.session_id for r in restored]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_second_load_all_does_not_leak_fds(tmp_path: Path) -> None:
    write_log(tmp_path, "s", META0, [1], [])
    store = TokenStore(tmp_path)
    before = open_fds()
    store.load_all()
    store.load_all()
    store.close()
    assert open_fds() == before


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_create_of_an_existing_id_is_refused_and_keeps_the_log(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    before = open_fds()
    store.create("s", {"created_at": 1.0}, [1])
    with pytest.raises(ValueError, match="already has a token log"):
        store.create("s", {"created_at": 2.0}, [2])
    store.close()
    assert open_fds() == before
    assert only(TokenStore(tmp_path).load_all(), "s").tokens == [1]


# ---- file modes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_logs_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    """Token logs are 0600 and the folders the store creates 0700, whatever the umask: a
    permissive one (0, or 022 outside systemd) cannot widen them, a strict one cannot make them
    unusable."""
    root = tmp_path / "state"
    old = os.umask(umask)
    try:
        store = TokenStore(root / "sessions" / "logs")
        store.create("a", {"created_at": 1.0}, [1, 2])
        store.append("a", [3])
        store.cut("a", 2)
        store.create("b", {"created_at": 2.0}, [])
        store.set_meta("b", {"created_at": 2.0, "x": 1})
        store.create("c", {"created_at": 3.0}, [4])
        store.delete("c")
        store.close()
        again = TokenStore(root / "sessions" / "logs")
        assert [r.session_id for r in again.load_all()] == ["a", "b"]
        again.append("a", [5])
        again.close()
    finally:
        os.umask(old)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == ["a.h3log", "b.h3log"]
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o600, f"{p.name}: {oct(p.stat().st_mode & 0o777)}"
    for d in (root, root / "sessions", root / "sessions" / "logs"):
        assert d.stat().st_mode & 0o777 == 0o700, f"{d}: {oct(d.stat().st_mode & 0o777)}"


class HeldFsyncs(FileOps):
    """Records (inode, thread name) of each fsync; one on a thread other than the test's waits for
    `release` (a slow disk behind); `fail` makes those fail (EIO)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []
        self.release = threading.Event()
        self.fail = False

    def fsync(self, fd: int) -> None:
        name = threading.current_thread().name
        self.calls.append((os.fstat(fd).st_ino, name))
        if name != "MainThread":
            assert self.release.wait(10)
            if self.fail:
                raise OSError(5, "fsync failed (a test's disk)")
        super().fsync(fd)


def test_group_commit_behind_counts_a_log_synced_only_once_its_fsync_returned(tmp_path: Path) -> None:
    held = HeldFsyncs()
    store = TokenStore(tmp_path, fsync_interval_ms=0, files=held)
    store.create("a", {"created_at": 1.0}, [1])
    store.create("b", {"created_at": 2.0}, [2])
    a, b = inode(tmp_path, "a"), inode(tmp_path, "b")
    held.calls.clear()
    store.append("a", [3])
    store.append("b", [4])

    store.sync_due(behind=True)  # returns at once: the fsyncs wait on the store's thread
    for _ in range(1000):
        if held.calls:
            break
        time.sleep(0.01)
    assert held.calls[0][1] == "h3d-log-sync_0"
    assert store.unsynced("a") and store.unsynced("b")  # in flight is not durable
    store.append("b", [5])
    store.sync_due(behind=True)  # one commit in flight at a time: nothing more submitted
    assert len(held.calls) == 1

    store.sync("a")  # the end of a Generate: fsyncs a itself, on its own thread
    assert held.calls[-1] == (a, "MainThread") and not store.unsynced("a")
    held.release.set()
    store.close()  # waits for the commit behind, then syncs b's write made after it began
    behind = [ino for ino, name in held.calls if name != "MainThread"]
    assert sorted(behind) == sorted([a, b])
    assert (b, "MainThread") in held.calls


def test_a_failed_fsync_behind_is_raised_by_the_next_sync_of_that_log(tmp_path: Path) -> None:
    held = HeldFsyncs()
    held.fail = True
    held.release.set()
    store = TokenStore(tmp_path, fsync_interval_ms=0, files=held)
    store.create("a", {"created_at": 1.0}, [1])
    store.create("b", {"created_at": 2.0}, [2])
    store.append("a", [3])
    store.sync_due(behind=True)
    store.settle()
    assert [name for _, name in held.calls] == ["MainThread"] * 2 + ["h3d-log-sync_0"]  # the creates, then behind
    assert store.unsynced("a")  # never counted durable
    store.sync("b")  # another log's sync does not see a's failure
    with pytest.raises(OSError, match="fsync failed"):
        store.sync("a")
    store.sync("a")  # raised once (after fsyncing it again on this thread)
    assert not store.unsynced("a")
    store.close()


def test_a_fork_holds_a_prefix_of_its_source_with_its_messages(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    store.create("a", {"owner": "x"}, [1, 2, 3])
    user = {"role": "user", "content": "hi", "n": 2}
    turn = {"turn": True, "n": 1}
    store.append_message("a", user, [4, 5])  # tokens 3..4
    store.append("a", [6, 7])
    store.cut("a", 6)  # (7 goes)
    store.append_message("a", turn, [8])  # token 6
    store.append("a", [9, 10])
    got = store.fork("a", "b", {"owner": "y"}, 8)
    assert got.tokens == [1, 2, 3, 4, 5, 6, 8, 9] and got.messages == [(user, 3), (turn, 6)]
    logged = read_log(tmp_path / f"b{SUFFIX}")
    assert (logged.tokens, logged.messages, logged.meta, logged.truncated_bytes) == (got.tokens, got.messages,
                                                                                    {"owner": "y"}, 0)  # fmt: skip
    assert read_log(tmp_path / f"a{SUFFIX}").tokens == [1, 2, 3, 4, 5, 6, 8, 9, 10]  # the source as it was
    assert store.fork("a", "e", {}, 3).messages == [] and read_log(tmp_path / f"e{SUFFIX}").tokens == [1, 2, 3]
    with pytest.raises(ValueError, match="inside a chat message"):
        store.fork("a", "c", {}, 4)
    with pytest.raises(ValueError, match="holds 9 tokens"):
        store.fork("a", "c", {}, 10)
    with pytest.raises(ValueError, match="no token log"):
        store.fork("zz", "c", {}, 0)
    with pytest.raises(ValueError, match="already has a token log"):
        store.fork("a", "b", {}, 1)
    assert not (tmp_path / f"c{SUFFIX}").exists() and store.open_sessions() == {"a", "b", "e"}
    store.append("b", [11])  # a fork's log goes on as any other
    store.close()
    again = {r.session_id: r for r in TokenStore(tmp_path).load_all()}
    assert again["b"].tokens == [1, 2, 3, 4, 5, 6, 8, 9, 11] and again["b"].messages == [(user, 3), (turn, 6)]


class Mirror:
    """A `LogMirror` that records what it is told (and refuses creations while `refuse`)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self.refuse = False

    def creating(self, session_id: str) -> None:
        if self.refuse:
            raise RuntimeError("no lease")
        self.calls.append(("creating", session_id, 0))

    def written(self, session_id: str, size: int) -> None:
        self.calls.append(("written", session_id, size))

    def deleted(self, session_id: str) -> None:
        self.calls.append(("deleted", session_id, 0))


def test_a_mirror_is_told_of_every_log_change_in_order(tmp_path: Path) -> None:
    """Told before a log is created (a refusal creates nothing), of each write with the file's new
    size once it holds it, of a deletion; a log restored from elsewhere or deleted only here is not told."""
    mirror = Mirror()
    store = TokenStore(tmp_path, mirror=mirror)
    store.create("s1", {"owner": "o"}, [1, 2])
    created = (tmp_path / f"s1{SUFFIX}").stat().st_size
    store.append("s1", [3])
    store.fork("s1", "s2", {}, 2)
    store.delete("s2")
    assert mirror.calls == [
        ("creating", "s1", 0), ("written", "s1", created), ("written", "s1", store.size("s1")),
        ("creating", "s2", 0), ("written", "s2", mirror.calls[4][2]), ("deleted", "s2", 0),
    ]  # fmt: skip
    assert store.size("s1") == (tmp_path / f"s1{SUFFIX}").stat().st_size
    assert read_log(tmp_path / f"s2{SUFFIX}").closed  # (left for the mirror to delete once its copy is gone)
    mirror.calls.clear()
    mirror.refuse = True
    with pytest.raises(RuntimeError, match="no lease"):
        store.create("s3", {}, [1])
    assert not (tmp_path / f"s3{SUFFIX}").exists() and "s3" not in store.open_sessions()
    data = (tmp_path / f"s1{SUFFIX}").read_bytes()
    assert store.restore("s4", data).tokens == [1, 2, 3]
    store.delete("s4", mirrored=False)
    assert mirror.calls == [] and not (tmp_path / f"s4{SUFFIX}").exists()
    with pytest.raises(ValueError, match="torn"):
        store.restore("s5", data[:-2])
    store.close()

    class FullDisk(FileOps):
        def create(self, path: Path, flags: int) -> int:
            raise OSError(28, "No space left on device")

    mirror = Mirror()
    full = TokenStore(tmp_path / "full", files=FullDisk(), mirror=mirror)
    with pytest.raises(OSError, match="No space"):
        full.create("s6", {}, [1])
    assert mirror.calls == [("creating", "s6", 0), ("deleted", "s6", 0)]  # (the copy begun is dropped)
