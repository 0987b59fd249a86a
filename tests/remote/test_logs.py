"""The token logs' copies in the store (`RemoteLogs`), against a real redis-server: the store's log
follows the file's, a write is acknowledged only once the store holds it, a store that went down
is caught up with when it is back, a lease another daemon took stops the copy, and a release hands
the session over with its whole log."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from h3d.remote.local import LocalRedis
from h3d.remote.logs import RemoteLogs
from h3d.remote.store import Fenced, Held, RemoteStore, RemoteUnavailable
from h3d.store.tokenlog import CLOSED, TokenStore, parse_log, record


def logs_for(server: LocalRedis, folder: Path, owner: str, **kw: float) -> RemoteLogs:
    store = RemoteStore(server.url, namespace="t", owner=owner, **kw)
    return RemoteLogs(store, lambda s: folder / f"{s}.h3log")


def mirrored(server: LocalRedis, folder: Path, owner: str, **kw: float) -> tuple[TokenStore, RemoteLogs]:
    """A token store in `folder` whose logs the store copies (`TokenStore.mirror`), as a daemon's."""
    remote = logs_for(server, folder, owner, **kw)
    remote.start()
    return TokenStore(folder, mirror=remote), remote


def wait_stored(remote: RemoteLogs, timeout: float = 15.0) -> None:
    """Until the store holds every log's bytes written so far."""
    time.sleep(0.05)  # (what `written` told reaches the store's thread first)
    deadline = time.monotonic() + timeout
    while remote.lag_bytes() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert remote.lag_bytes() == 0


def size(folder: Path, session: str) -> int:
    return (folder / f"{session}.h3log").stat().st_size


def test_the_stores_log_follows_the_file(redis_server: LocalRedis, tmp_path: Path) -> None:
    files = TokenStore(tmp_path / "a")
    remote = logs_for(redis_server, tmp_path / "a", "daemon-a")
    assert remote.start() == "appendonly yes, appendfsync always"
    assert remote.take("s1") == 0
    files.create("s1", {"owner": "o"}, [1, 2, 3])
    remote.written("s1", size(tmp_path / "a", "s1"))
    for i in range(50):
        files.append("s1", [10 + i])
        remote.written("s1", size(tmp_path / "a", "s1"))
    remote.durable("s1", size(tmp_path / "a", "s1")).result(10)
    stored = remote.fetch("s1")
    assert stored == (tmp_path / "a" / "s1.h3log").read_bytes()
    assert parse_log("s1", stored).tokens == [1, 2, 3, *range(10, 60)]
    assert remote.lag_bytes() == 0 and remote.degraded is None
    other = logs_for(redis_server, tmp_path / "b", "daemon-b")
    other.start()
    with pytest.raises(Held, match="daemon-a"):
        other.take("s1")
    remote.release("s1")  # handed over: the other daemon takes it at once, with the whole log
    assert other.take("s1") == len(stored)
    other.close()
    remote.close()
    files.close()


def test_a_store_down_fails_the_wait_and_is_caught_up_with(redis_server: LocalRedis, tmp_path: Path) -> None:
    files, remote = mirrored(redis_server, tmp_path / "a", "daemon-a", timeout_s=0.5, lease_s=30)
    files.create("s1", {}, [1])  # (its lease taken, its bytes copied: the store log's mirror)
    wait_stored(remote)  # (polled: a wait of `durable` would be bounded by the short timeout)
    redis_server.stop()
    files.append("s1", [2, 3])
    remote.written("s1", size(tmp_path / "a", "s1"))
    t0 = time.monotonic()
    with pytest.raises(RemoteUnavailable):
        remote.durable("s1", size(tmp_path / "a", "s1")).result(10)  # sync: bounded by timeout_s
    assert time.monotonic() - t0 < 3
    assert remote.degraded is not None and remote.lag_bytes() > 0
    redis_server.start()  # (its AOF: what it acknowledged is back)
    deadline = time.monotonic() + 15
    while remote.lag_bytes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert remote.lag_bytes() == 0 and remote.degraded is None  # caught up by itself
    assert parse_log("s1", remote.fetch("s1") or b"").tokens == [1, 2, 3]
    remote.close()
    files.close()


def test_a_lease_another_daemon_took_stops_the_copy(redis_server: LocalRedis, tmp_path: Path) -> None:
    """A daemon cut off long enough loses its lease to another: its next renewal finds it gone,
    the session is reported lost, and nothing more of its file reaches the store."""
    files, remote = mirrored(redis_server, tmp_path / "a", "daemon-a", lease_s=0.3)
    files.create("s1", {}, [1])  # (its lease taken, its bytes copied: the store log's mirror)
    remote.durable("s1", size(tmp_path / "a", "s1")).result(10)
    # (as if it had expired and daemon B had taken it: in one step, so that A cannot take it back first)
    redis.Redis.from_url(redis_server.url).set("h3d:t:{s1}:lease", "daemon-b 999", px=60_000)
    deadline = time.monotonic() + 5
    while "s1" not in remote.lost() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "gone" in remote.lost()["s1"]
    stored = remote.fetch("s1")
    files.append("s1", [2])
    remote.written("s1", size(tmp_path / "a", "s1"))
    with pytest.raises(Fenced):
        remote.durable("s1", size(tmp_path / "a", "s1")).result(10)
    assert remote.fetch("s1") == stored
    remote.close()
    files.close()


def test_at_start_the_local_logs_are_reconciled_with_the_stores(redis_server: LocalRedis, tmp_path: Path) -> None:
    """Before a restarted daemon reads its logs: a tail the store lacks is copied (a torn record
    never), a log the store changed since (another daemon served it) replaces the file, a session
    another daemon serves now is dropped here, and one deleted here is deleted from the store."""
    files = TokenStore(tmp_path / "a")
    for sid in ("tail", "changed", "elsewhere", "torn", "deleted"):
        files.create(sid, {}, [1, 2])
    files.close()
    folder = tmp_path / "a"
    other = logs_for(redis_server, tmp_path / "b", "daemon-b")
    other.start()
    first = (folder / "changed.h3log").read_bytes()
    for sid in ("tail", "changed", "elsewhere", "torn", "deleted"):
        other.take(sid)
        (tmp_path / "b").mkdir(exist_ok=True)
        (tmp_path / "b" / f"{sid}.h3log").write_bytes((folder / f"{sid}.h3log").read_bytes())
        other.written(sid, size(folder, sid))
        other.durable(sid, size(folder, sid)).result(10)
    changed = TokenStore(tmp_path / "b")
    changed.load_all()
    changed.cut("changed", 1)  # another daemon rewound it
    changed.append("changed", [7])
    other.written("changed", size(tmp_path / "b", "changed"))
    other.durable("changed", size(tmp_path / "b", "changed")).result(10)
    changed.close()
    for sid in ("tail", "changed", "torn", "deleted"):
        other.release(sid)
    again = TokenStore(folder)
    again.load_all()
    again.append("tail", [3])
    again.delete("deleted")
    again.close()
    (folder / "deleted.h3log").write_bytes(first + record(CLOSED, b""))  # (a crash before the file went)
    with open(folder / "torn.h3log", "ab") as f:
        f.write(b"H3\x02\x08\x00")  # a record cut short by a crash
    remote = logs_for(redis_server, folder, "daemon-a")
    remote.start()
    gone, replaced = remote.reconcile(sorted(folder.glob("*.h3log")))
    assert gone == ["elsewhere"] and replaced == ["changed"] and not (folder / "elsewhere.h3log").exists()
    assert parse_log("changed", (folder / "changed.h3log").read_bytes()).tokens == [1, 7]
    remote.durable("tail", size(folder, "tail")).result(10)
    assert remote.fetch("tail") == (folder / "tail.h3log").read_bytes()
    assert parse_log("tail", remote.fetch("tail") or b"").tokens == [1, 2, 3]
    torn = remote.fetch("torn") or b""
    assert parse_log("torn", torn).truncated_bytes == 0 and parse_log("torn", torn).tokens == [1, 2]
    assert remote.fetch("deleted") is None
    remote.close()
    other.close()


def test_a_lease_that_expired_while_the_store_was_away_is_taken_again(redis_server: LocalRedis, tmp_path: Path) -> None:
    """The store gone longer than a lease (its keys' lives run out, or it restarts past them): if no
    other daemon took the session meanwhile, the daemon takes its lease again, with a new token,
    and the copy goes on; the session is not lost."""
    files, remote = mirrored(redis_server, tmp_path / "a", "daemon-a", lease_s=0.6, timeout_s=0.2)
    files.create("s1", {}, [1])  # (its lease taken, its bytes copied: the store log's mirror)
    wait_stored(remote)  # (polled: a wait of `durable` would be bounded by the short timeout)
    redis_server.stop()
    files.append("s1", [2])
    remote.written("s1", size(tmp_path / "a", "s1"))
    time.sleep(1.0)  # past the lease
    redis_server.start()  # (the lease's time to live ran out: gone at load)
    deadline = time.monotonic() + 10
    while remote.lag_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert remote.lag_bytes() == 0 and not remote.lost()
    assert parse_log("s1", remote.fetch("s1") or b"").tokens == [1, 2]
    holder = remote.holder("s1")
    assert holder is not None and holder.startswith("daemon-a ") and holder != "daemon-a 1"
    remote.close()
    files.close()


def test_a_delete_or_a_release_the_store_missed_is_not_forgotten(redis_server: LocalRedis, tmp_path: Path) -> None:
    """A release that fails leaves the session copied and held here (released once the store is
    back); a deletion while the store is down reaches it once it is back."""
    files = TokenStore(tmp_path / "a")
    remote = logs_for(redis_server, tmp_path / "a", "daemon-a", timeout_s=0.3, lease_s=30)
    remote.start()
    for sid in ("kept", "gone"):
        remote.take(sid)
        files.create(sid, {}, [1])
        remote.written(sid, size(tmp_path / "a", sid))
        wait_stored(remote)  # (polled: a wait of `durable` would be bounded by the short timeout)
    redis_server.stop()
    files.append("kept", [2])
    remote.written("kept", size(tmp_path / "a", "kept"))
    with pytest.raises(RemoteUnavailable):
        remote.release("kept")
    remote.deleted("gone")
    redis_server.start()
    deadline = time.monotonic() + 15
    while remote.lag_bytes() and time.monotonic() < deadline:  # still copied from here
        time.sleep(0.1)
    assert parse_log("kept", remote.fetch("kept") or b"").tokens == [1, 2]
    deadline = time.monotonic() + 15
    while remote.fetch("gone") is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert remote.fetch("gone") is None and remote.holder("gone") is None
    remote.release("kept")
    assert remote.holder("kept") is None
    remote.close()
    files.close()


def test_a_deletion_the_store_missed_before_a_stop_reaches_it_at_the_next_start(
    redis_server: LocalRedis, tmp_path: Path
) -> None:
    """The local file (its CLOSED record written) stays until the store's log is gone: a daemon
    that stops first deletes that log at its next start, so a deleted session never comes back."""
    folder = tmp_path / "a"
    files, remote = mirrored(redis_server, folder, "daemon-a", timeout_s=0.3, lease_s=30)
    files.create("gone", {}, [1, 2])
    wait_stored(remote)
    redis_server.stop()
    files.delete("gone")
    time.sleep(0.3)  # (the store's thread tries, and fails)
    assert parse_log("gone", (folder / "gone.h3log").read_bytes()).closed  # (kept: the store still has it)
    remote.close()
    files.close()
    redis_server.start()
    assert parse_log("gone", logs_for(redis_server, folder, "reader").fetch("gone") or b"").tokens == [1, 2]
    again = logs_for(redis_server, folder, "daemon-a", timeout_s=0.3, lease_s=30)
    again.start()
    assert again.reconcile(sorted(folder.glob("*.h3log"))) == ([], [])
    assert again.fetch("gone") is None and again.holder("gone") is None
    assert TokenStore(folder, mirror=again).load_all() == [] and not list(folder.glob("*.h3log"))
    again.close()

    # With the store there, the file goes once the store's log has.
    files, remote = mirrored(redis_server, folder, "daemon-a")
    files.create("quick", {}, [3])
    wait_stored(remote)
    files.delete("quick")
    deadline = time.monotonic() + 15
    while (folder / "quick.h3log").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (folder / "quick.h3log").exists() and remote.fetch("quick") is None
    remote.close()
    files.close()
