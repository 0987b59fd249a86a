"""The gRPC services `h3.v1.H3` and `h3.v1.H3Admin` over the engine worker.

Each RPC reads as: authenticate (`Auth`), check the request, run what touches the engine on the
engine thread (`EngineWorker.call` / `start_request`), translate the result into messages. The
handler table (`handlers`) wraps every method the same way: malformed messages (invalid UTF-8 is
caught while parsing) become INVALID_ARGUMENT, `H3Error`s become their status
(`h3d.daemon.status`), anything else INTERNAL with the traceback in the log, and every call ends in
one `rpc` log event and the metrics.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError, Message

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.config import POLICIES
from h3d.daemon.auth import Auth, Caller
from h3d.daemon.config import DaemonConfig
from h3d.daemon.metrics import Metrics
from h3d.daemon.status import Draining, Overloaded, status_of
from h3d.daemon.worker import EngineWorker
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import (
    AppendDone,
    FinishReason,
    GenerationDone,
    PrefillProgress,
    RequestFailed,
    Session,
    SessionId,
    TokenDelta,
)
from h3d.errors import H3Error, InvalidRequest, SessionBusy, SessionNotFound, clip

log = structlog.get_logger("h3d.rpc")

FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
MAX_PAGE = 1000
DEFAULT_PAGE = 100
MAX_STOP_STRINGS = 16
SESSION_ID = re.compile(r"[0-9a-f]{32}")


class State:
    """What both services share: the worker, callers' sessions, backpressure and draining."""

    def __init__(self, config: DaemonConfig, worker: EngineWorker, auth: Auth, metrics: Metrics) -> None:
        self.config = config
        self.worker = worker
        self.auth = auth
        self.metrics = metrics
        self.owners: dict[SessionId, str] = {}  # the event loop's: read and written on it only
        self.in_flight = 0  # AppendContext + Generate streams admitted
        self.draining = False
        self.started = time.time()
        self.request_ids = itertools.count(1)

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

    def check_owner(self, caller: Caller, session_id: str) -> SessionId:
        if not SESSION_ID.fullmatch(session_id):
            raise InvalidRequest(f"session_id: {clip(session_id)!r} is not a session id (32 lowercase hex digits)")
        sid = SessionId(session_id)
        owner = self.owners.get(sid)
        if owner is None or (owner != caller.owner and not caller.admin):
            raise SessionNotFound(f"no session {session_id!r}")
        return sid


# ---- conversions (engine thread: they read engine state) ---------------------------------------


def residency_pb(engine: Engine, session: Session) -> pb.TierResidency:
    hbm, ddr, ssd = engine.runner.tiers.residency(session.seq)
    return pb.TierResidency(hbm_blocks=hbm, ddr_blocks=ddr, ssd_blocks=ssd)


def expire_pin(engine: Engine, session: Session) -> None:
    """Drop a session's pin once its TTL has passed (checked whenever it is read, and periodically)."""
    if session.pinned_until is not None and session.pinned_until <= time.time():
        engine.set_pin(session.id, None)


def session_pb(engine: Engine, session: Session, with_tokens: bool = False) -> pb.Session:
    expire_pin(engine, session)
    s = session.sampling
    out = pb.Session(
        session_id=session.id,
        num_tokens=len(session.tokens),
        cached_tokens=engine.runner.cached_tokens(session.seq),
        policy=session.policy,
        created_at=session.created_at,
        last_used_at=session.last_used_at,
        busy=session.busy,
        pinned=session.pinned_until is not None,
        pinned_until=session.pinned_until if session.pinned_until not in (None, math.inf) else 0.0,
        sampling=pb.SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
        ),
        residency=residency_pb(engine, session),
        window_tokens=engine.runner.selection[session.seq].window_tokens,
        closed=session.closed,
        chat=session.chat is not None,
        num_messages=len(session.chat.messages) + (session.chat.open_at is not None) if session.chat else 0,
    )
    if s.seed is not None:
        out.sampling.seed = s.seed
    if with_tokens:
        out.token_ids.extend(session.tokens)
        out.text = engine.tokenizer.decode(session.tokens)
    return out


def tier_stats_pb(engine: Engine) -> pb.TierStats:
    t = engine.tier_stats()
    p50, p99 = engine.hbf_latency_us()
    return pb.TierStats(
        hbm_hit_rate=t.hbm_hit_rate,
        hbm_hits=t.hbm_hits,
        hbm_misses=t.hbm_misses,
        ddr_evict_count=t.ddr_evict_count,
        hbm_evict_count=t.hbm_evict_count,
        ssd_read_count=t.ssd_read_count,
        ssd_write_count=t.ssd_write_count,
        hbf_latency_us_p50=p50,
        hbf_latency_us_p99=p99,
        hbm_used_bytes=t.hbm_used_bytes,
        hbm_capacity_bytes=t.hbm_capacity_bytes,
        ddr_used_bytes=t.ddr_used_bytes,
        ddr_capacity_bytes=t.ddr_capacity_bytes,
        ssd_used_bytes=t.ssd_used_bytes,
        fetch_bytes=t.fetch_bytes,
        kv_rebuild_blocks=t.kv_rebuild_blocks,
        ssd_degraded=t.ssd_degraded,
        ssd_degraded_reason=engine.runner.tiers.ssd_degraded or "",
        ssd_write_errors=t.ssd_write_errors,
        recompute_evict_count=t.recompute_evict_count,
    )


def sampling_from(base: SamplingParams, msg: pb.SamplingParams, limit: int) -> SamplingParams:
    """`base` with the fields `msg` sets, checked (max_tokens within 1..limit). A max_tokens the
    request leaves unset (the session's or the daemon's default) is capped at the limit."""
    over: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if msg.HasField(name):
            over[name] = getattr(msg, name)
    if msg.stop:
        if len(msg.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(msg.stop)}")
        over["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        over["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.ignore_eos:
        over["ignore_eos"] = True
    params = replace(base, **over)
    if "max_tokens" not in over:
        params = replace(params, max_tokens=min(params.max_tokens, limit))
    if not 1 <= params.max_tokens <= limit:
        raise InvalidRequest(f"max_tokens must be within 1..{limit} (max_tokens_limit), got {params.max_tokens}")
    return params.validate()  # temperatures below sampling.MIN_TEMPERATURE sample greedily


def check_token_ids(engine: Engine, ids: list[int], field: str) -> None:
    vocab = engine.model.config.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{field}: token id {bad} is outside the vocabulary (size {vocab})")


# ---- H3 ------------------------------------------------------------------------------------


class H3Servicer:
    def __init__(self, state: State) -> None:
        self.s = state

    async def CreateSession(self, request: pb.CreateSessionRequest, context: Any, caller: Caller) -> pb.Session:
        self.s.accepting()
        policy = request.policy or None
        if policy is not None and policy not in POLICIES:
            raise InvalidRequest(f"policy: {clip(policy)!r} is not one of {', '.join(POLICIES)}")
        limit = self.s.config.max_tokens_limit

        def create(engine: Engine) -> pb.Session:
            defaults = engine.with_sampling()
            params = sampling_from(defaults, request.sampling, limit)  # an unset message sets no field
            sid = engine.create_session(
                request.system_prompt or None, params, policy, owner=caller.owner, chat=request.chat
            )
            return session_pb(engine, engine.session(sid))

        session = await self.s.worker.call(create)
        self.s.owners[SessionId(session.session_id)] = caller.owner  # on the loop, which owns the map
        return session

    async def GetSession(self, request: pb.GetSessionRequest, context: Any, caller: Caller) -> pb.Session:
        sid = self.s.check_owner(caller, request.session_id)
        return await self.s.worker.call(lambda e: session_pb(e, e.session(sid), request.with_tokens))

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Any, caller: Caller
    ) -> pb.ListSessionsResponse:
        size = request.page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise InvalidRequest(f"page_size: at most {MAX_PAGE}, got {size}")
        after = _cursor(request.page_token)
        mine = [sid for sid, owner in self.s.owners.items() if owner == caller.owner or caller.admin]

        def page(engine: Engine) -> pb.ListSessionsResponse:
            sessions = sorted((engine.session(sid) for sid in mine if sid in engine.sessions), key=_age)
            rest = [s for s in sessions if after is None or _age(s) > after]
            chunk = rest[:size]
            more = len(rest) > size
            return pb.ListSessionsResponse(
                sessions=[session_pb(engine, s) for s in chunk],
                next_page_token=f"{chunk[-1].created_at!r}/{chunk[-1].id}" if more else "",
                total=len(sessions),
            )

        return await self.s.worker.call(page)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: Any, caller: Caller
    ) -> pb.CloseSessionResponse:
        sid = self.s.check_owner(caller, request.session_id)
        await self.s.worker.call(lambda e: e.close_session(sid, purge=request.purge))
        if request.purge:
            self.s.owners.pop(sid, None)
        return pb.CloseSessionResponse()

    async def AppendContext(
        self, request: pb.AppendContextRequest, context: Any, caller: Caller
    ) -> AsyncIterator[pb.AppendContextResponse]:
        self.s.accepting()
        sid = self.s.check_owner(caller, request.session_id)
        if request.text and request.token_ids:
            raise InvalidRequest("give text or token_ids, not both")
        if not request.text and not request.token_ids:
            raise InvalidRequest("append needs text or token_ids")
        ids = list(request.token_ids)
        with self.s.slot():

            def submit(engine: Engine) -> Any:
                check_token_ids(engine, ids, "token_ids")
                return engine.submit(
                    sid, text=request.text or None, token_ids=ids or None, generate=False, role=request.role or None
                )

            rid, events = await self.s.worker.start_request(submit)
            finished = False
            try:
                while True:
                    event = await events.get()
                    if isinstance(event, PrefillProgress):
                        yield pb.AppendContextResponse(
                            progress=pb.AppendProgress(tokens_done=event.done, tokens_total=event.total)
                        )
                    elif isinstance(event, AppendDone):
                        finished = True
                        n = await self.s.worker.call(lambda e: len(e.session(sid).tokens))
                        yield pb.AppendContextResponse(
                            done=pb.AppendSummary(
                                tokens_added=event.tokens_added, prefill_s=event.prefill_s, num_tokens=n
                            )
                        )
                        return
                    elif isinstance(event, RequestFailed):
                        finished = True
                        raise event.error
            finally:
                if not finished:
                    self.s.worker.cancel(rid)

    async def Generate(
        self, request: pb.GenerateRequest, context: Any, caller: Caller
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.s.accepting()
        sid = self.s.check_owner(caller, request.session_id)
        if request.prompt and request.prompt_token_ids:
            raise InvalidRequest("give prompt or prompt_token_ids, not both")
        ids = list(request.prompt_token_ids)
        limit = self.s.config.max_tokens_limit
        started = time.perf_counter()  # TTFT counts the prompt's prefill too
        with self.s.slot():
            if request.prompt or ids:
                # As `Engine.generate`: append the prompt first, so that (append T; generate) and
                # (generate T) feed the same tokens in the same chunks.
                def append(engine: Engine) -> Any:
                    session = engine.session(sid)
                    if session.busy:
                        raise SessionBusy(f"session {sid} already has a request in flight")
                    sampling_from(session.sampling, request.sampling, limit)  # refuse before appending
                    check_token_ids(engine, ids, "prompt_token_ids")
                    return engine.submit(sid, text=request.prompt or None, token_ids=ids or None, generate=False)

                rid, events = await self.s.worker.start_request(append)
                try:
                    while True:
                        event = await events.get()
                        if isinstance(event, RequestFailed):
                            raise event.error
                        if isinstance(event, AppendDone):
                            break
                except BaseException:
                    self.s.worker.cancel(rid)
                    raise

            def submit(engine: Engine) -> Any:
                params = sampling_from(engine.session(sid).sampling, request.sampling, limit)
                return engine.submit(sid, generate=True, params=params)

            rid, events = await self.s.worker.start_request(submit)
            finished = False
            first: float | None = None
            last = started
            try:
                while True:
                    event = await events.get()
                    if isinstance(event, TokenDelta):
                        now = time.perf_counter()
                        self.s.metrics.token(now - last, first=first is None)
                        first = first or now
                        last = now
                        yield pb.GenerateResponse(delta=pb.TokenDelta(text=event.text, token_ids=[event.token_id]))
                    elif isinstance(event, GenerationDone):
                        finished = True
                        ttft = (first or time.perf_counter()) - started
                        summary = await self.s.worker.call(
                            functools.partial(_summary, sid=sid, done=event, ttft_s=ttft)
                        )
                        yield pb.GenerateResponse(done=summary)
                        return
                    elif isinstance(event, RequestFailed):
                        finished = True
                        raise event.error
            finally:
                if not finished:
                    self.s.worker.cancel(rid)

    async def GetStats(self, request: pb.GetStatsRequest, context: Any, caller: Caller) -> pb.Stats:
        if request.session_id:
            ids = [self.s.check_owner(caller, request.session_id)]
        else:
            ids = [sid for sid, owner in self.s.owners.items() if owner == caller.owner or caller.admin]
        return await self.s.worker.call(lambda e: stats_pb(self.s, e, ids))


def _age(session: Session) -> tuple[float, str]:
    return session.created_at, session.id


def _cursor(token: str) -> tuple[float, str] | None:
    """A page token: the (created_at, id) of the last session of the previous page, so that pages
    stay consistent while sessions open and close between calls."""
    if not token:
        return None
    created, sep, sid = token.partition("/")
    try:
        at = float(created)
    except ValueError:
        at = math.nan
    if not sep or not sid or not math.isfinite(at):
        raise InvalidRequest("page_token: not a token from a previous ListSessions")
    return at, sid


def _summary(engine: Engine, *, sid: SessionId, done: GenerationDone, ttft_s: float) -> pb.GenerateSummary:
    residency = residency_pb(engine, engine.session(sid)) if sid in engine.sessions else pb.TierResidency()
    return pb.GenerateSummary(
        finish_reason=FINISH[done.finish_reason],
        prompt_tokens=done.prompt_tokens,
        completion_tokens=len(done.token_ids),
        ttft_s=ttft_s,
        tokens_per_s=done.decode_tokens_per_s,
        residency=residency,
        tier_stats=tier_stats_pb(engine),
    )


def stats_pb(state: State, engine: Engine, ids: list[SessionId]) -> pb.Stats:
    sessions = []
    for sid in ids:
        session = engine.sessions.get(sid)
        if session is None:
            continue
        mine = engine.runner.tiers.per_session.get(session.seq)
        sessions.append(
            pb.SessionStats(
                session_id=sid,
                num_tokens=len(session.tokens),
                residency=residency_pb(engine, session),
                hbm_hit_rate=mine.hbm_hit_rate if mine else 1.0,
                ssd_read_count=mine.ssd_read_count if mine else 0,
                window_tokens=engine.runner.selection[session.seq].window_tokens,
            )
        )
    active = len(engine.requests())
    return pb.Stats(
        **{"global": tier_stats_pb(engine)},
        sessions=sessions,
        throughput=pb.Throughput(
            tokens_per_s=state.worker.throughput(),
            window_s=10.0,
            generated_tokens_total=engine.counters.generated_tokens,
            prefill_tokens_total=engine.counters.prefill_tokens,
            active_requests=min(active, engine.config.max_batch_size),
            queued_requests=max(active - engine.config.max_batch_size, 0),
            sessions=len(engine.sessions),
        ),
        uptime_s=time.time() - state.started,
        draining=state.draining,
    )


# ---- H3Admin -------------------------------------------------------------------------------


class H3AdminServicer:
    def __init__(
        self,
        state: State,
        drain: Callable[[float], Awaitable[tuple[int, int]]],
        resume: Callable[[], Awaitable[bool]],
    ) -> None:
        self.s = state
        self._drain = drain
        self._resume = resume

    async def EvictSession(
        self, request: pb.EvictSessionRequest, context: Any, caller: Caller
    ) -> pb.EvictSessionResponse:
        sid = self.s.check_owner(caller, request.session_id)
        if request.to not in (pb.TIER_DDR, pb.TIER_SSD):
            raise InvalidRequest("to: must be TIER_DDR or TIER_SSD")

        def evict(engine: Engine) -> pb.EvictSessionResponse:
            session = engine.session(sid)
            if session.busy:
                raise SessionBusy(f"session {sid} has a request in flight: evict it when idle")
            moved = engine.runner.tiers.demote(session.seq, to_ssd=request.to == pb.TIER_SSD)
            return pb.EvictSessionResponse(blocks_moved=moved, residency=residency_pb(engine, session))

        return await self.s.worker.call(evict)

    async def PinSession(self, request: pb.PinSessionRequest, context: Any, caller: Caller) -> pb.Session:
        sid = self.s.check_owner(caller, request.session_id)
        if not (math.isfinite(request.ttl_s) and request.ttl_s >= 0):
            raise InvalidRequest(f"ttl_s: must be a number >= 0, got {request.ttl_s}")

        def pin(engine: Engine) -> pb.Session:
            engine.set_pin(sid, None if request.unpin else time.time() + request.ttl_s if request.ttl_s else math.inf)
            return session_pb(engine, engine.session(sid))

        return await self.s.worker.call(pin)

    async def SnapshotSession(
        self, request: pb.SnapshotSessionRequest, context: Any, caller: Caller
    ) -> pb.SnapshotSessionResponse:
        sid = self.s.check_owner(caller, request.session_id)

        def snapshot(engine: Engine) -> pb.SnapshotSessionResponse:
            t0 = time.perf_counter()
            written = engine.runner.tiers.snapshot(engine.session(sid).seq)
            return pb.SnapshotSessionResponse(blocks_written=written, seconds=time.perf_counter() - t0)

        return await self.s.worker.call(snapshot)

    async def SetPolicy(self, request: pb.SetPolicyRequest, context: Any, caller: Caller) -> pb.Session:
        sid = self.s.check_owner(caller, request.session_id)

        def set_policy(engine: Engine) -> pb.Session:
            engine.set_policy(sid, request.policy)
            return session_pb(engine, engine.session(sid))

        return await self.s.worker.call(set_policy)

    async def Drain(self, request: pb.DrainRequest, context: Any, caller: Caller) -> pb.DrainResponse:
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            raise InvalidRequest(f"timeout_s: must be a number >= 0, got {request.timeout_s}")
        finished, cancelled = await self._drain(request.timeout_s or self.s.config.drain_timeout_s)
        return pb.DrainResponse(requests_finished=finished, requests_cancelled=cancelled)

    async def Resume(self, request: pb.ResumeRequest, context: Any, caller: Caller) -> pb.ResumeResponse:
        return pb.ResumeResponse(was_draining=await self._resume())

    async def GetConfig(self, request: pb.GetConfigRequest, context: Any, caller: Caller) -> pb.GetConfigResponse:
        return pb.GetConfigResponse(json=self.s.config.to_json())


# ---- the handler table ---------------------------------------------------------------------


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
    level("rpc", method=name, request_id=rid, session_id=session_id, code=code.name, ms=round(ms, 2))
