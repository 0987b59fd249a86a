"""The remote store against a real redis-server: leases and their fencing tokens (a stale holder's
writes refused and nothing written), a token log read back as its file is, what an acknowledged
write survives (the server killed), the durability check, an unreachable store, and URLs that
never show a password."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis

from h3d.remote.local import LocalRedis
from h3d.remote.store import Fenced, Held, Lease, NotDurable, RemoteError, RemoteStore, RemoteUnavailable, redact
from h3d.store.tokenlog import TOKENS, TokenStore, record

T = TypeVar("T")


def run(body: Callable[[], Awaitable[T]]) -> T:
    return asyncio.run(body())  # type: ignore[arg-type]


def store(server: LocalRedis, owner: str, **kw: Any) -> RemoteStore:
    return RemoteStore(server.url, namespace="test", owner=owner, **kw)


def tokens(ids: list[int]) -> bytes:
    return record(TOKENS, struct.pack(f"<{len(ids)}I", *ids))


async def add(s: RemoteStore, lease: Lease, data: bytes) -> int:
    """Append at the end of the store's log (as a daemon whose file matches it does)."""
    return await s.append(lease, data, at=await s.log_size(lease.session))


def test_a_lease_is_one_daemons_and_a_stale_holder_writes_nothing(redis_server: LocalRedis) -> None:
    async def body() -> None:
        a, b = store(redis_server, "daemon-a", lease_s=0.3), store(redis_server, "daemon-b", lease_s=0.3)
        lease = await a.acquire("s1")
        await add(a, lease, tokens([1, 2, 3]))
        with pytest.raises(Held) as held:
            await b.acquire("s1")
        assert held.value.holder == lease.value and "daemon-a" in str(held.value)
        assert await b.holder("s1") == lease.value
        await asyncio.sleep(0.45)  # a's lease expires (a stopped renewing it: killed, or cut off)
        taken = await b.acquire("s1")
        assert taken.token > lease.token
        with pytest.raises(Fenced):
            await add(a, lease, tokens([99]))  # the stale holder: refused, nothing written
        with pytest.raises(Fenced):
            await a.renew(lease)
        with pytest.raises(Fenced):
            await a.delete(lease)
        assert not await a.release(lease)
        await add(b, taken, tokens([4]))
        restored = await a.load("s1")  # (reading needs no lease)
        assert restored is not None and restored.tokens == [1, 2, 3, 4]
        again = await b.acquire("s1")  # the same owner takes it again: a new token, the old one fenced
        assert again.token > taken.token
        with pytest.raises(Fenced):
            await add(b, taken, tokens([5]))
        await b.renew(again)
        assert await b.release(again) and await b.holder("s1") is None
        lease = await a.acquire("s1")  # released: taken at once, no expiry waited for
        await a.delete(lease)
        assert await a.load("s1") is None and await a.holder("s1") is None
        await a.close()
        await b.close()

    run(body)


def test_a_remote_log_reads_back_as_the_file_does(redis_server: LocalRedis, tmp_path: Path) -> None:
    """The same records through the store and through a token log file give the same session."""
    file = TokenStore(tmp_path / "logs")
    file.create("s1", {"owner": "o", "policy": "full"}, [5, 6, 7])
    file.append("s1", [8, 9])
    file.append_message("s1", {"role": "user", "content": "hi"}, [10, 11])
    file.cut("s1", 4)
    file.set_meta("s1", {"policy": "quest"})
    file.sync()
    data = (tmp_path / "logs" / "s1.h3log").read_bytes()
    [want] = file.load_all()
    file.close()

    async def body() -> None:
        s = store(redis_server, "d")
        lease = await s.acquire("s1")
        for piece in (data[:40], data[40:]):  # appended in pieces, as a daemon writes
            await add(s, lease, piece)
        got = await s.load("s1")
        assert got == want and got.tokens == [5, 6, 7, 8]
        assert await s.sessions() == ["s1"]
        await s.close()

    run(body)


def test_acknowledged_appends_survive_the_store_killed(redis_server: LocalRedis) -> None:
    """appendfsync always: what `append` acknowledged is on the server's disk; a SIGKILL of the
    server loses none of it."""

    async def write() -> int:
        s = store(redis_server, "d")
        assert await s.check_durable() == "appendonly yes, appendfsync always"
        lease = await s.acquire("s1")
        for i in range(200):
            await add(s, lease, tokens([i]))
        await s.close()
        return lease.token

    token = run(write)
    redis_server.kill()
    redis_server.start()

    async def read() -> None:
        s = store(redis_server, "d")
        got = await s.load("s1")
        assert got is not None and got.tokens == list(range(200))
        assert (await s.acquire("s1")).token == token + 1  # (the fence counter survived too)
        await s.close()

    run(read)


def test_the_sync_modes_check_refuses_a_store_that_may_lose_writes(redis_server: LocalRedis) -> None:
    async def body() -> None:
        s, admin = store(redis_server, "d"), aioredis.Redis.from_url(redis_server.url)
        await admin.config_set("appendfsync", "everysec")
        with pytest.raises(NotDurable, match=r"appendfsync everysec.*appendfsync always"):
            await s.check_durable()
        await admin.config_set("appendonly", "no")
        with pytest.raises(NotDurable, match="appendonly no"):
            await s.check_durable()
        await s.close()
        await admin.aclose()

    run(body)


def test_an_unreachable_store_is_named_and_bounded_in_time() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # (nothing listens once it is closed)

    async def body() -> None:
        s = RemoteStore(f"redis://127.0.0.1:{port}/0", namespace="t", owner="d", timeout_s=0.5)
        with pytest.raises(RemoteUnavailable, match=f"127.0.0.1:{port}"):
            await s.ping()
        await s.close()

    run(body)


def test_urls_never_show_a_password() -> None:
    assert redact("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact("rediss://user:s3cret@host/2") == "rediss://user:***@host/2"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
    with pytest.raises(RemoteError, match="remote_password_file") as err:
        RemoteStore("redis://:s3cret@host:6379/0", namespace="t", owner="d")
    assert "s3cret" not in str(err.value)
    with pytest.raises(RemoteError, match="scheme"):
        RemoteStore("http://host:6379", namespace="t", owner="d")
    with pytest.raises(RemoteError, match="owner"):
        RemoteStore("redis://host:6379", namespace="t", owner="two words")


def test_an_append_lands_once_at_its_offset(redis_server: LocalRedis) -> None:
    """An append names the offset it goes at: a retry of one that landed (its reply lost) is taken
    as done, not written twice; one at another offset (another writer, a gap) writes nothing."""

    async def body() -> None:
        s = store(redis_server, "d")
        lease = await s.acquire("s1")
        one, two = tokens([1, 2]), tokens([3])
        assert await s.append(lease, one, at=0) == len(one)
        assert await s.append(lease, one, at=0) == len(one)  # the retry
        with pytest.raises(Fenced, match=f"log is {len(one)} bytes, not 5"):
            await s.append(lease, two, at=5)
        with pytest.raises(Fenced, match="not 0"):
            await s.append(lease, two, at=0)  # (other bytes at that offset)
        assert await s.append(lease, two, at=len(one)) == len(one) + len(two)
        got = await s.load("s1")
        assert got is not None and got.tokens == [1, 2, 3]
        three = tokens([4])
        # A retry carrying more than its first try (whose reply was lost): what landed is kept, the rest appended.
        assert await s.append(lease, two + three, at=len(one)) == len(one) + len(two) + len(three)
        got = await s.load("s1")
        assert got is not None and got.tokens == [1, 2, 3, 4]
        await s.close()

    run(body)


def test_leases_are_renewed_many_to_a_round_trip(redis_server: LocalRedis) -> None:
    """`renew_many` (pipelines of the renewal script, loaded again if the server forgot it): whether
    each lease is still held."""

    async def body() -> None:
        a, b = store(redis_server, "daemon-a", lease_s=60), store(redis_server, "daemon-b", lease_s=60)
        leases = [await a.acquire(f"s{i}") for i in range(600)]  # (more than one pipeline; none expires meanwhile)
        admin = aioredis.Redis.from_url(redis_server.url)
        await admin.script_flush()
        assert await a.renew_many(leases) == [True] * 600
        await admin.delete("h3d:test:{s7}:lease")
        await b.acquire("s7")
        held = await a.renew_many(leases)
        assert held == [i != 7 for i in range(600)]
        await admin.aclose()
        await a.close()
        await b.close()

    run(body)
