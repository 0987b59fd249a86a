"""The remote tier's store: sessions' token logs and leases in a server that speaks the Redis
protocol (Redis, Valkey, a managed Redis), through redis-py's asyncio client.

Why redis-py: it is the protocol's reference Python client, kept by Redis, pure Python (no native
core to build or ship beside torch), with an asyncio API, connection pools, and Lua scripts run by
their digest (`register_script`: EVALSHA, EVAL once if the server lacks it). valkey-glide has a
Rust core and a younger API; nothing here needs what it adds (cluster routing is the server's).

A session lives in the store under keys that share one hash tag, so that a cluster keeps them on
one node and a script may touch them together (prefix `h3d:<namespace>:`; the namespace names the
cache the daemons share, so that daemons of other models never meet):
- `{<session>}:log`: its token log, the same records as its file (`h3d.store.tokenlog.record`),
  appended; `h3d.store.tokenlog.parse_log` reads it back;
- `{<session>}:lease`: `<owner> <token>` while a daemon serves it, with a time to live (`lease_s`)
  its holder renews; once it has expired any daemon may take the session;
- `{<session>}:fence`: the counter its fencing tokens come from (each lease taken gets a larger
  one than every lease before it);
- `{<session>}:digests` and `{<session>}:digests:<i>`: the digest snapshot its last holder wrote
  when it gave the session up (`put_digests`: what it covers, named by content, then the pieces).

KV blocks are keyed by content, not by session (`kv:<layout>:<layer>:<digest>`, `h3d.remote.kv`).

What must stay true:
- a log is changed only by its lease's holder: each write carries the holder's `<owner> <token>`,
  which the server compares with the lease in the same script (atomically); a stale holder (its
  lease expired, or taken since by another daemon) is refused (`Fenced`) and changes nothing;
- a lease is taken only when it is free, expired, or held by the same owner (then with a new
  token: the old one's writes are refused from then on);
- `check_durable` (the `sync` mode's check at connect) passes only where the server persists every
  write before it acknowledges it: `appendonly yes` with `appendfsync always`. Replicas
  acknowledged through `WAIT` are not supported: a replica's copy is not on its disk when WAIT
  returns unless it too runs `appendfsync always`, which this check cannot see;
- no error message or log line shows a password (`redact`); a password never comes in the URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import zlib
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from h3d.errors import Fenced, Held, KVNoRoom, NotDurable, RemoteError, RemoteUnavailable
from h3d.store.tokenlog import Restored, parse_log

T = TypeVar("T")

SCHEMES = ("redis", "rediss", "unix")
KV_PIPELINE_BYTES = 16 << 20  # KV blocks written per round trip (each within the call's timeout)
KV_MGET_KEYS = 64  # KV blocks read per round trip
KV_TOUCH_KEYS = 4096  # KV blocks renewed per round trip
DIGEST_PIECE_BYTES = 64 << 20  # a digest snapshot is stored in values of at most this
KV_MAX_FILL = 0.8  # KV blocks never take a store with a maxmemory past this share of it: the rest is the logs'
RENEW_BATCH = 512  # leases renewed per round trip


@dataclass(frozen=True, slots=True)
class Lease:
    """A daemon's hold on a session: the fencing `token` its writes carry."""

    session: str
    owner: str
    token: int

    @property
    def value(self) -> str:
        return f"{self.owner} {self.token}"


def redact(url: str) -> str:
    """`url` with its password (if any) shown as `***`."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def check_url(url: str) -> None:
    """Refuse (RemoteError) a URL that is not a Redis one, or that carries a password."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise RemoteError(f"remote URL {redact(url)!r}: the scheme must be one of {', '.join(SCHEMES)}")
    if parts.password is not None:
        raise RemoteError(
            f"remote URL {redact(url)!r} carries a password, which would be shown wherever the URL is: "
            "put it in a file of its own (remote_password_file) and take it out of the URL"
        )


# The scripts. KEYS and ARGV as each names them; each returns what its method says.
_ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, string.len(ARGV[1]) + 1) ~= ARGV[1] .. ' ' then
  return {0, cur}
end
local token = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. token, 'PX', ARGV[2])
return {1, token}
"""  # KEYS: lease, fence; ARGV: owner, ttl ms -> {1, token} or {0, holder}
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""  # KEYS: lease; ARGV: holder, ttl ms
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""  # KEYS: lease; ARGV: holder
_APPEND = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return -1
end
local at = tonumber(ARGV[3])
local size = redis.call('STRLEN', KEYS[2])
local n = string.len(ARGV[2])
if size == at then
  return redis.call('APPEND', KEYS[2], ARGV[2])
end
local landed = size > at and size <= at + n
if landed and redis.call('GETRANGE', KEYS[2], at, size - 1) == string.sub(ARGV[2], 1, size - at) then
  if size < at + n then
    return redis.call('APPEND', KEYS[2], string.sub(ARGV[2], size - at + 1))
  end
  return size
end
return -2 - size
"""  # KEYS: lease, log; ARGV: holder, bytes, the offset they go at -> the log's length; -1: fenced;
# -2 - size: the log is `size` bytes and not a prefix of these at the offset (what an earlier try of
# some of these bytes landed is taken as done, the rest appended)
_DELETE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[2], KEYS[1])
return 1
"""  # KEYS: lease, log; ARGV: holder


class RemoteStore:
    """One daemon's connection to the store. `owner` names the daemon in the leases it takes
    (unique among the daemons sharing the store); `timeout_s` bounds every call (RemoteUnavailable
    past it); `lease_s`: a lease's time to live, which its holder renews (`renew`) well within.
    The methods are coroutines of the loop the store is used from (one loop)."""

    def __init__(
        self,
        url: str,
        *,
        namespace: str,
        owner: str,
        password: str | None = None,
        timeout_s: float = 5.0,
        lease_s: float = 10.0,
    ) -> None:
        check_url(url)
        if " " in owner or not owner:
            raise RemoteError(f"a daemon's owner name must be a word without spaces, got {owner!r}")
        if timeout_s <= 0 or lease_s <= 0:
            raise RemoteError(f"timeout_s and lease_s must be > 0, got {timeout_s}, {lease_s}")
        self.url, self.namespace, self.owner = url, namespace, owner
        self.timeout_s, self.lease_s = timeout_s, lease_s
        self._redis = aioredis.Redis.from_url(
            url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        r = self._redis
        self._acquire, self._renew = r.register_script(_ACQUIRE), r.register_script(_RENEW)
        self._release, self._append = r.register_script(_RELEASE), r.register_script(_APPEND)
        self._delete = r.register_script(_DELETE)

    def _key(self, session: str, what: str) -> str:
        return f"h3d:{self.namespace}:{{{session}}}:{what}"

    async def _call(self, what: str, call: Awaitable[T]) -> T:
        """`call` within the timeout; the client's errors as RemoteUnavailable, naming `what`."""
        try:
            return await asyncio.wait_for(call, self.timeout_s)
        except TimeoutError as e:
            raise RemoteUnavailable(f"remote store {redact(self.url)}: {what} took over {self.timeout_s} s") from e
        except ResponseError as e:
            raise RemoteError(f"remote store {redact(self.url)}: {what} refused: {e}") from e
        except RedisError as e:
            raise RemoteUnavailable(f"remote store {redact(self.url)}: {what} failed: {e}") from e

    # ---- the store ----------------------------------------------------------------------------

    async def ping(self) -> None:
        await self._call("PING", self._redis.ping())

    async def check_durable(self) -> str:
        """Raise NotDurable unless the store persists each write before acknowledging it; returns
        what was found (for the log)."""
        try:
            conf: dict[str, Any] = await self._call("CONFIG GET", self._redis.config_get("append*"))
        except RemoteUnavailable:
            raise
        except RemoteError as e:
            raise NotDurable(
                f"{e}; the sync mode checks that the store runs appendonly yes with appendfsync always "
                "(a managed store that refuses CONFIG: run remote_log = async, knowing what it may lose)"
            ) from e
        found = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in conf.items()}
        found = {(k.decode() if isinstance(k, bytes) else k): v for k, v in found.items()}
        aof, fsync = found.get("appendonly"), found.get("appendfsync")
        if aof != "yes" or fsync != "always":
            raise NotDurable(
                f"remote store {redact(self.url)} runs appendonly {aof}, appendfsync {fsync}: a write it "
                "acknowledged may be lost if it stops, and remote_log = sync promises the opposite; set "
                "appendonly yes and appendfsync always on it (CONFIG SET, or its configuration file), or "
                "run remote_log = async"
            )
        return f"appendonly {aof}, appendfsync {fsync}"

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()

    # ---- leases -------------------------------------------------------------------------------

    async def acquire(self, session: str) -> Lease:
        """Take `session`'s lease (free, expired, or this owner's: a new token). Raises Held."""
        keys = [self._key(session, "lease"), self._key(session, "fence")]
        got, value = await self._call(
            f"taking session {session}'s lease", self._acquire(keys, [self.owner, int(self.lease_s * 1000)])
        )
        if not got:
            holder = value.decode() if isinstance(value, bytes) else str(value)
            raise Held(f"session {session} is served by another daemon ({holder.split(' ')[0]})", holder)
        return Lease(session, self.owner, int(value))

    async def renew(self, lease: Lease) -> None:
        """Extend `lease` by `lease_s` from now. Raises Fenced if it is no longer held."""
        done = await self._call(
            f"renewing session {lease.session}'s lease",
            self._renew([self._key(lease.session, "lease")], [lease.value, int(self.lease_s * 1000)]),
        )
        if not done:
            raise Fenced(f"session {lease.session}: this daemon's lease (token {lease.token}) is gone", lease_gone=True)

    async def renew_many(self, leases: list[Lease]) -> list[bool]:
        """`renew` of many leases, `RENEW_BATCH` to a round trip. -> whether each is still held (its
        time to live extended)."""
        out: list[bool] = []
        ttl = int(self.lease_s * 1000)
        for i in range(0, len(leases), RENEW_BATCH):
            pipe = self._redis.pipeline(transaction=False)
            part = leases[i : i + RENEW_BATCH]
            for lease in part:
                await self._renew([self._key(lease.session, "lease")], [lease.value, ttl], client=pipe)
            out += [bool(x) for x in await self._call(f"renewing {len(part)} leases", pipe.execute())]
        return out

    async def release(self, lease: Lease) -> bool:
        """Give `lease` up (another daemon may take the session at once). -> whether it was held."""
        key = self._key(lease.session, "lease")
        return bool(await self._call(f"releasing session {lease.session}'s lease", self._release([key], [lease.value])))

    async def holder(self, session: str) -> str | None:
        """Who serves `session` now (`<owner> <token>`), or None; read without taking it."""
        value = await self._call(f"reading session {session}'s lease", self._redis.get(self._key(session, "lease")))
        return None if value is None else value.decode()

    # ---- logs ---------------------------------------------------------------------------------

    async def append(self, lease: Lease, data: bytes, at: int) -> int:
        """Append token-log records (`h3d.store.tokenlog.record`) to the session's log at offset
        `at` (its length: appended once whatever the retries), acknowledged by the store when this
        returns. -> the log's length. Raises Fenced, nothing written: the lease is gone, or the log
        is not `at` bytes long (another writer)."""
        keys = [self._key(lease.session, "lease"), self._key(lease.session, "log")]
        what = f"appending to session {lease.session}'s log"
        size = int(await self._call(what, self._append(keys, [lease.value, data, at])))
        if size == -1:
            raise Fenced(
                f"session {lease.session}: not written, this daemon's lease (token {lease.token}) is gone",
                lease_gone=True,
            )
        if size < -1:
            raise Fenced(f"session {lease.session}: not written, the store's log is {-2 - size} bytes, not {at}")
        return size

    async def log_size(self, session: str) -> int:
        """The bytes of `session`'s log in the store (0 if it has none)."""
        return int(await self._call(f"reading session {session}'s log", self._redis.strlen(self._key(session, "log"))))

    async def log_bytes(self, session: str) -> bytes | None:
        """`session`'s log as the store holds it, or None."""
        data = await self._call(f"reading session {session}'s log", self._redis.get(self._key(session, "log")))
        return None if data is None else bytes(data)

    async def load(self, session: str) -> Restored | None:
        """`session` as its log in the store tells it, or None if the store has no log of it."""
        data = await self.log_bytes(session)
        return None if data is None else parse_log(session, data)

    async def delete(self, lease: Lease) -> None:
        """Delete the session's log and its lease. Raises Fenced (nothing deleted)."""
        keys = [self._key(lease.session, "lease"), self._key(lease.session, "log")]
        if not await self._call(f"deleting session {lease.session}", self._delete(keys, [lease.value])):
            raise Fenced(f"session {lease.session}: not deleted, this daemon's lease (token {lease.token}) is gone")

    def kv_key(self, layout: str, layer: int, digest: str) -> str:
        """A KV block's key: content-addressed (`h3d.remote.kv`), not a session's."""
        return f"h3d:{self.namespace}:kv:{layout}:{layer}:{digest}"

    async def put_kv(self, items: list[tuple[str, bytes]], ttl_s: int) -> None:
        """Write KV blocks ((key, value) each; a key is its content, so writing one again changes
        nothing but its expiry, renewed to `ttl_s`), in pipelines of about `KV_PIPELINE_BYTES`.
        Raises KVNoRoom (what was written stays) rather than take a store with a `maxmemory` past
        `KV_MAX_FILL` of it: the KV is a cache, the room left is for the token logs, which are the
        sessions' truth (a full store ends `sync` streams with UNAVAILABLE)."""
        start = 0
        while start < len(items):
            end, size = start, 0
            while end < len(items) and (end == start or size < KV_PIPELINE_BYTES):
                size += len(items[end][1])
                end += 1
            memory = await self._call("reading the store's memory", self._redis.info("memory"))
            cap, used = int(memory.get("maxmemory", 0)), int(memory.get("used_memory", 0))
            if cap and used + size > KV_MAX_FILL * cap:
                raise KVNoRoom(
                    f"the remote store holds {used} of its maxmemory {cap} bytes: KV blocks may take "
                    f"{KV_MAX_FILL:.0%} of it, the rest is kept for the token logs"
                )
            pipe = self._redis.pipeline(transaction=False)
            for key, value in items[start:end]:
                pipe.set(key, value, ex=ttl_s)
            await self._call(f"writing {end - start} KV blocks", pipe.execute())
            start = end

    async def put_digests(self, session: str, head: dict[str, object], data: bytes, ttl_s: int) -> None:
        """A session's digest snapshot (`h3d.tiers.digestfile`: its file's bytes), in pieces of
        `DIGEST_PIECE_BYTES` (a value is at most 512 MB), then `head` (JSON: what it covers) with
        the pieces' count and crc32: a reader takes it only whole. Lives `ttl_s` like the KV."""
        what = f"writing session {session}'s digests"
        n = -(-len(data) // DIGEST_PIECE_BYTES)
        for i in range(n):
            piece = data[i * DIGEST_PIECE_BYTES : (i + 1) * DIGEST_PIECE_BYTES]
            await self._call(what, self._redis.set(self._key(session, f"digests:{i}"), piece, ex=ttl_s))
        value = json.dumps({**head, "pieces": n, "bytes": len(data), "crc": zlib.crc32(data)})
        await self._call(what, self._redis.set(self._key(session, "digests"), value, ex=ttl_s))

    async def digests_head(self, session: str) -> dict[str, Any] | None:
        """`put_digests`' head (with the snapshot's `bytes`), or None."""
        raw = await self._call(f"reading session {session}'s digests", self._redis.get(self._key(session, "digests")))
        return None if raw is None else dict(json.loads(raw))

    async def get_digest_piece(self, session: str, index: int) -> bytes | None:
        """Piece `index` of `session`'s digest snapshot (`DIGEST_PIECE_BYTES` at most), or None."""
        what = f"reading session {session}'s digests"
        return await self._call(what, self._redis.get(self._key(session, f"digests:{index}")))

    async def touch_kv(self, keys: list[str], ttl_s: int) -> list[bool]:
        """Whether the store has each of `keys`; those it has live `ttl_s` from now (EXPIRE, in
        pipelines of `KV_TOUCH_KEYS`)."""
        out: list[bool] = []
        for i in range(0, len(keys), KV_TOUCH_KEYS):
            part = keys[i : i + KV_TOUCH_KEYS]
            pipe = self._redis.pipeline(transaction=False)
            for key in part:
                pipe.expire(key, ttl_s)
            out += [bool(x) for x in await self._call(f"renewing {len(part)} KV blocks", pipe.execute())]
        return out

    async def get_kv(self, keys: list[str]) -> list[bytes | None]:
        """The values of `keys` (None where the store has none), in MGETs of `KV_MGET_KEYS`."""
        out: list[bytes | None] = []
        for i in range(0, len(keys), KV_MGET_KEYS):
            part = keys[i : i + KV_MGET_KEYS]
            out += await self._call(f"reading {len(part)} KV blocks", self._redis.mget(part))
        return out

    async def sessions(self) -> list[str]:
        """Every session with a log in the store (of this namespace), in no order."""
        prefix = f"h3d:{self.namespace}:{{"

        async def scan() -> list[str]:
            out = []
            async for key in self._redis.scan_iter(match=f"{prefix}*}}:log", count=1000):
                name = key.decode()
                out.append(name[len(prefix) : -len("}:log")])
            return out

        return await self._call("listing the sessions", scan())


def digests_whole(head: dict[str, Any], pieces: list[bytes | None]) -> bytes | None:
    """A digest snapshot from its `pieces` (`RemoteStore.get_digest_piece`) if they make the one
    `head` (`RemoteStore.digests_head`) describes, else None (a piece expired or torn)."""
    if any(p is None for p in pieces):
        return None
    data = b"".join(p for p in pieces if p is not None)
    if len(data) != head["bytes"] or zlib.crc32(data) != head["crc"]:
        return None
    return data
