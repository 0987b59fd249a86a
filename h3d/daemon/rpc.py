"""What both gRPC services (`h3.v1.H3`: h3d.daemon.service, `h3.v1.H3Admin`: h3d.daemon.admin)
share: `State` and the handler table.

`State` holds the worker, which caller owns which session (the event loop's map), the bound on
streaming requests in flight and the draining flag. The handler table (`handlers`) wraps every
method the same way: malformed messages (invalid UTF-8 is caught while parsing) become
INVALID_ARGUMENT, `H3Error`s become their status (`h3d.daemon.status`), anything else INTERNAL with
the traceback in the log, and every call ends in one `rpc` log event and the metrics. What must
stay true: no traceback reaches a client; a session is seen only by its creator (or an admin).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError, Message

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.auth import LOCAL, Auth, Caller
from h3d.daemon.config import DaemonConfig
from h3d.daemon.metrics import Metrics
from h3d.daemon.status import Draining, Overloaded, status_of
from h3d.daemon.worker import EngineWorker
from h3d.engine.session import NewSession, SessionId
from h3d.errors import H3Error, InvalidRequest, SessionNotFound, clip
from h3d.store.tokenlog import parse_log

log = structlog.get_logger("h3d.rpc")

SESSION_ID = re.compile(r"[0-9a-f]{32}")
GAPS = 512  # tokens per session whose gaps Stats' itl_ms_p50/p99 are over


class State:
    """What both services share: the worker, callers' sessions, backpressure and draining."""

    def __init__(self, config: DaemonConfig, worker: EngineWorker, auth: Auth, metrics: Metrics) -> None:
        self.config = config
        self.worker = worker
        self.auth = auth
        self.metrics = metrics
        self.owners: dict[SessionId, str] = {}  # the event loop's: read and written on it only
        self._taking: dict[SessionId, asyncio.Lock] = {}  # sessions being taken over from the remote store
        self.in_flight = 0  # AppendContext + Generate streams admitted
        self.draining = False
        self.started = time.time()
        self.request_ids = itertools.count(1)
        self.resolved: dict[str, object] = {}  # what the `auto` keys were sized to (GetConfig's "resolved")
        # per session, the gaps (s) between the last GAPS tokens the daemon sent (Stats' itl_ms_p50/p99)
        self.gaps: dict[SessionId, deque[float]] = {}

    def token_gap(self, sid: SessionId, gap_s: float) -> None:
        """A token of `sid` sent `gap_s` after its previous one (on the loop)."""
        gaps = self.gaps.get(sid)
        if gaps is None:
            gaps = self.gaps[sid] = deque(maxlen=GAPS)
        gaps.append(gap_s)

    def prune_gaps(self, live: Iterable[SessionId]) -> None:
        """Forget the gaps of sessions that are gone."""
        keep = set(live)
        for sid in [s for s in self.gaps if s not in keep]:
            del self.gaps[sid]

    def accepting(self) -> None:
        if self.draining:
            raise Draining("the daemon is draining: it takes no new requests")

    @contextmanager
    def slot(self) -> Iterator[None]:
        """Admit one streaming request, or refuse it (RESOURCE_EXHAUSTED) past the bound."""
        if self.in_flight >= self.config.max_pending_requests:
            raise Overloaded(
                f"{self.in_flight} requests are in flight (max_pending_requests={self.config.max_pending_requests}); "
                f"retry in {self.config.retry_after_ms} ms",
                self.config.retry_after_ms,
            )
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def owned(self, caller: Caller, session_id: str) -> SessionId:
        """`check_owner`, after taking over a session that the remote store has and this daemon
        does not (`Engine.adopt`: its lease, its log; Held if another daemon serves it)."""
        sid = SessionId(session_id)
        engine = self.worker.engine
        if sid not in self.owners and SESSION_ID.fullmatch(session_id) and engine.remote is not None:
            lock = self._taking.setdefault(sid, asyncio.Lock())
            async with lock:  # (two calls naming it at once take it over once)
                if sid not in self.owners:
                    await self._take_over(engine, sid, caller)
            self._taking.pop(sid, None)
        return self.check_owner(caller, session_id)

    async def _take_over(self, engine: Any, sid: SessionId, caller: Caller) -> None:
        """A session the store has and this daemon does not, taken over if it is the caller's:
        the store's part off the engine thread (`Engine.take_over`), then `Engine.adopt` on it."""
        remote = engine.remote
        data = await asyncio.to_thread(remote.fetch, sid)  # (read, not taken: whose is it?)
        if data is None:
            return
        owner = str(parse_log(sid, data).meta.get("owner", "")) or LOCAL
        if owner != caller.owner and not caller.admin:
            return  # (not the caller's: NOT_FOUND, and it stays where it is)
        taken = await asyncio.to_thread(engine.take_over, sid)
        if taken is None:
            return
        session = await self.worker.call(lambda e: e.adopt(sid, taken.data))
        self.owners[sid] = session.owner or LOCAL
        pairs = (("read_estimate_s", taken.read_estimate_s), ("prefill_estimate_s", taken.prefill_estimate_s))
        est = {k: None if v is None else round(v, 3) for k, v in pairs}
        log.info("session_taken_over", session_id=sid, tokens=len(session.tokens), kv_source=taken.kv_source,
                 kv_blocks_read=taken.kv_blocks, kv_bytes_read=taken.kv_bytes, kv_read_s=round(taken.kv_s, 3),
                 digest_blocks_read=taken.digest_blocks, digest_read_s=round(taken.digest_s, 3), **est)  # fmt: skip

    async def make_session(self, prepare: Callable[[], NewSession]) -> NewSession:
        """Run `prepare` (the request's checks and `Engine.prepare_session`: the token log written,
        durable) off the engine's thread, and hand the session to the engine, which takes it in
        between two steps, before any command posted after this returns: a session is made
        without waiting for a step boundary. A caller that leaves meanwhile leaves the session
        made all the same, as a command on the engine's thread would have."""
        made = asyncio.get_running_loop().run_in_executor(None, prepare)

        def take_in(done: asyncio.Future[NewSession]) -> None:  # (before the awaiting handler resumes)
            if not done.cancelled() and done.exception() is None:
                new = done.result()
                self.worker.post(lambda e: e.add_session(new))

        made.add_done_callback(take_in)
        return await asyncio.shield(made)

    async def stored(self, sid: SessionId, size: int | None = None) -> None:
        """With the remote tier in `sync` mode: once the store holds `sid`'s log as it is now, or
        its first `size` bytes (a session made here is answered only then); RemoteUnavailable
        past the timeout."""
        engine = self.worker.engine
        remote, journal = engine.remote, engine.journal
        if remote is None or not remote.sync or journal is None:
            return
        await asyncio.wrap_future(remote.durable(sid, journal.size(sid) if size is None else size))

    def check_id(self, session_id: str) -> SessionId:
        if not SESSION_ID.fullmatch(session_id):
            raise InvalidRequest(f"session_id: {clip(session_id)!r} is not a session id (32 lowercase hex digits)")
        return SessionId(session_id)

    def check_owner(self, caller: Caller, session_id: str) -> SessionId:
        sid = self.check_id(session_id)
        owner = self.owners.get(sid)
        if owner is None or (owner != caller.owner and not caller.admin):
            raise SessionNotFound(f"no session {session_id!r}")
        return sid


class _Malformed:
    """What the request deserializer returns for bytes protobuf refuses (e.g. invalid UTF-8)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parser(cls: type[Message]) -> Callable[[bytes], Message | _Malformed]:
    def parse(data: bytes) -> Message | _Malformed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:
            return _Malformed(str(exc) or type(exc).__name__)

    return parse


def handlers(state: State, servicer: Any, service: str, admin: bool) -> grpc.GenericRpcHandler:
    desc = pb.DESCRIPTOR.services_by_name[service]
    table = {}
    for method in desc.methods:
        req_cls = getattr(pb, method.input_type.name)
        resp_cls = getattr(pb, method.output_type.name)
        impl = getattr(servicer, method.name)
        if method.server_streaming:
            table[method.name] = grpc.unary_stream_rpc_method_handler(
                _stream(state, impl, method.name, admin),
                request_deserializer=_parser(req_cls),
                response_serializer=resp_cls.SerializeToString,
            )
        else:
            table[method.name] = grpc.unary_unary_rpc_method_handler(
                _unary(state, impl, method.name, admin),
                request_deserializer=_parser(req_cls),
                response_serializer=resp_cls.SerializeToString,
            )
    return grpc.method_handlers_generic_handler(desc.full_name, table)


def _begin(state: State, request: Any, context: Any, admin: bool) -> Caller:
    if isinstance(request, _Malformed):
        raise InvalidRequest(f"malformed request (it could not be parsed): {request.reason}")
    return state.auth.caller(context.invocation_metadata(), admin)


async def _fail(state: State, context: Any, name: str, rid: int, exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, H3Error):
        code = status_of(exc)
        if isinstance(exc, Overloaded):
            context.set_trailing_metadata((("retry-after-ms", str(exc.retry_after_ms)),))
        await context.abort(code, str(exc))
    log.error("rpc_internal_error", method=name, request_id=rid, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request {rid}); the daemon's log has the details")
    raise AssertionError("unreachable")  # pragma: no cover


def _unary(state: State, impl: Any, name: str, admin: bool) -> Any:
    async def call(request: Any, context: Any) -> Any:
        rid, t0, code = next(state.request_ids), time.perf_counter(), grpc.StatusCode.OK
        try:
            return await impl(request, context, _begin(state, request, context, admin))
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            if _is_abort(exc):
                raise
            code = status_of(exc) if isinstance(exc, H3Error) else grpc.StatusCode.INTERNAL
            await _fail(state, context, name, rid, exc)
        finally:
            _record(state, name, rid, request, code, t0)

    return call


def _stream(state: State, impl: Any, name: str, admin: bool) -> Any:
    async def call(request: Any, context: Any) -> AsyncIterator[Any]:
        rid, t0, code = next(state.request_ids), time.perf_counter(), grpc.StatusCode.OK
        try:
            async for item in impl(request, context, _begin(state, request, context, admin)):
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: grpc.aio cancels the handler's task or closes its generator.
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            if _is_abort(exc):
                raise
            code = status_of(exc) if isinstance(exc, H3Error) else grpc.StatusCode.INTERNAL
            await _fail(state, context, name, rid, exc)
        finally:
            _record(state, name, rid, request, code, t0)

    return call


def _is_abort(exc: BaseException) -> bool:
    return type(exc).__name__ == "AbortError"


def _record(state: State, name: str, rid: int, request: Any, code: grpc.StatusCode, t0: float) -> None:
    ms = (time.perf_counter() - t0) * 1000
    state.metrics.rpc(name, code.name, ms / 1000)
    session_id = clip(getattr(request, "session_id", "")) or None
    level = log.info if code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED) else log.warning
    if name in ("GetStats", "GetSession", "ListSessions", "GetConfig") and code == grpc.StatusCode.OK:
        level = log.debug
    level("rpc", api="grpc", method=name, request_id=rid, session_id=session_id, code=code.name, ms=round(ms, 2))
