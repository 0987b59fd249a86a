"""The gRPC service `h3.v1.H3` over the engine worker: sessions, appends, generation, stats.

Each RPC reads as: authenticate (`Auth`, through the handler table: h3d.daemon.rpc), check the
request, run what touches the engine on the engine thread (`EngineWorker.call` /
`start_request`), translate the result into messages (h3d.daemon.convert). What must stay true:
every session is its creator's (`State.check_owner`); a stream cancels its request on the engine
whenever it ends before the request did.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any

import structlog

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.config import POLICIES
from h3d.daemon.auth import Caller
from h3d.daemon.convert import (
    check_token_ids,
    new_session_pb,
    remote_session_pb,
    sampling_from,
    session_pb,
    stats_pb,
)
from h3d.daemon.generation import stream_append, stream_generation
from h3d.daemon.rpc import State
from h3d.daemon.worker import Finished
from h3d.engine.engine import Engine
from h3d.engine.session import NewSession, PrefillProgress, RequestId, Session, SessionId
from h3d.errors import InvalidRequest, SessionBusy, SessionNotFound, clip

log = structlog.get_logger("h3d.service")

MAX_PAGE = 1000
DEFAULT_PAGE = 100


class H3Servicer:
    def __init__(self, state: State) -> None:
        self.s = state

    async def CreateSession(self, request: pb.CreateSessionRequest, context: Any, caller: Caller) -> pb.Session:
        self.s.accepting()
        policy = request.policy or None
        if policy is not None and policy not in POLICIES:
            raise InvalidRequest(f"policy: {clip(policy)!r} is not one of {', '.join(POLICIES)}")
        limit = self.s.config.max_tokens_limit
        engine = self.s.worker.engine

        def prepare() -> NewSession:  # (reads the configuration and the tokenizer only)
            params = sampling_from(engine.with_sampling(), request.sampling, limit)  # an unset message sets no field
            return engine.prepare_session(
                request.system_prompt or None, params, policy, owner=caller.owner, chat=request.chat
            )

        # Answered without waiting for a step boundary (`State.make_session`).
        new = await self.s.make_session(prepare)
        session = new_session_pb(new)
        made = new.session.id
        self.s.owners[made] = caller.owner  # on the loop, which owns the map
        try:
            await self.s.stored(made, new.log_bytes)
        except BaseException:  # a session the store does not hold is not made (sync)
            self.s.owners.pop(made, None)
            self.s.worker.post(lambda e: e.close_session(made, purge=True))
            raise
        return session

    async def ForkSession(self, request: pb.ForkSessionRequest, context: Any, caller: Caller) -> pb.Session:
        self.s.accepting()
        sid = await self.s.owned(caller, request.session_id)
        at = request.at_tokens if request.HasField("at_tokens") else None

        def fork(engine: Engine) -> tuple[SessionId, bool]:
            made = engine.fork_session(sid, at, owner=caller.owner)
            session = engine.session(made)
            return made, engine.cached_tokens(made) < len(session.tokens) - 1

        made, tail = await self.s.worker.call(fork)
        self.s.owners[made] = caller.owner
        try:
            if tail:  # its last tokens prefilled now: the fork is ready to decode when it is answered

                def submit(engine: Engine) -> RequestId:
                    rid = engine.catch_up(made)
                    assert rid is not None, "a fork's tail to prefill"
                    return rid

                async with contextlib.aclosing(stream_append(self.s, submit)) as events:
                    async for _ in events:
                        pass
            await self.s.stored(made)
            return await self.s.worker.call(lambda e: session_pb(e, e.session(made)))
        except BaseException:  # a fork that is not ready is not made: nothing of it stays
            self.s.owners.pop(made, None)
            self.s.worker.post(lambda e: e.close_session(made, purge=True))
            raise

    async def GetSession(self, request: pb.GetSessionRequest, context: Any, caller: Caller) -> pb.Session:
        sid = SessionId(request.session_id)
        if request.take_over:
            sid = await self.s.owned(caller, request.session_id)
        elif sid not in self.s.owners and self.s.worker.engine.remote is not None:  # read from the store, not taken
            self.s.check_id(request.session_id)  # (the store's calls off the engine thread)
            return await asyncio.to_thread(remote_session_pb, self.s.worker.engine, sid, caller, request.with_tokens)
        sid = self.s.check_owner(caller, request.session_id)
        return await self.s.worker.call(lambda e: session_pb(e, e.session(sid), request.with_tokens))

    async def ReleaseSession(
        self, request: pb.ReleaseSessionRequest, context: Any, caller: Caller
    ) -> pb.ReleaseSessionResponse:
        sid = self.s.check_owner(caller, request.session_id)
        worker = self.s.worker

        async def hand_over() -> None:  # (the KV's and the log's writes to the store off the engine thread)
            tokens = await worker.call(lambda e: e.begin_hand_over(sid))
            try:
                await asyncio.to_thread(worker.engine.send_hand_over, sid, tokens)
            except BaseException:
                await worker.call(lambda e: e.end_hand_over(sid, released=False))
                raise
            await worker.call(lambda e: e.end_hand_over(sid, released=True))
            self.s.owners.pop(sid, None)

        await asyncio.shield(asyncio.ensure_future(hand_over()))  # (a caller gone does not stop it midway)
        log.info("session_released", session_id=sid)
        return pb.ReleaseSessionResponse()

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Any, caller: Caller
    ) -> pb.ListSessionsResponse:
        size = request.page_size or DEFAULT_PAGE
        if size > MAX_PAGE:
            raise InvalidRequest(f"page_size: at most {MAX_PAGE}, got {size}")
        after = _cursor(request.page_token)
        mine = [sid for sid, owner in self.s.owners.items() if owner == caller.owner or caller.admin]
        engine = self.s.worker.engine
        elsewhere: list[pb.Session] = []
        if request.all and engine.remote is not None:  # the store's others, read off the engine thread
            others = [SessionId(x) for x in await asyncio.to_thread(engine.remote.sessions) if x not in self.s.owners]
            for sid in others:
                with contextlib.suppress(SessionNotFound):  # (not the caller's, or gone meanwhile)
                    elsewhere.append(await asyncio.to_thread(remote_session_pb, engine, sid, caller))

        def page(engine: Engine) -> pb.ListSessionsResponse:
            here: list[tuple[tuple[float, str], Session | pb.Session]] = [
                (_age(s), s) for s in (engine.session(x) for x in mine if x in engine.sessions)
            ]
            every = sorted(here + [((s.created_at, s.session_id), s) for s in elsewhere], key=lambda x: x[0])
            rest = [(at, s) for at, s in every if after is None or at > after]
            chunk = rest[:size]
            more = len(rest) > size
            return pb.ListSessionsResponse(
                sessions=[s if isinstance(s, pb.Session) else session_pb(engine, s) for _, s in chunk],
                next_page_token=f"{chunk[-1][0][0]!r}/{chunk[-1][0][1]}" if more else "",
                total=len(every),
            )

        return await self.s.worker.call(page)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: Any, caller: Caller
    ) -> pb.CloseSessionResponse:
        sid = await self.s.owned(caller, request.session_id)
        if request.purge:  # answered once the session's data is gone
            await self.s.worker.call(lambda e: e.close_session(sid, purge=True))
            self.s.owners.pop(sid, None)
        else:
            # Answered once queued, not after the step in flight: commands run in order, so every
            # later call finds the session closed (its token log is already durable; its KV goes
            # to the archive once write-behind has written it, off the engine thread).
            self.s.worker.post(lambda e: e.close_session(sid, later=True))
        return pb.CloseSessionResponse()

    async def AppendContext(
        self, request: pb.AppendContextRequest, context: Any, caller: Caller
    ) -> AsyncIterator[pb.AppendContextResponse]:
        self.s.accepting()
        sid = await self.s.owned(caller, request.session_id)
        if request.text and request.token_ids:
            raise InvalidRequest("give text or token_ids, not both")
        if not request.text and not request.token_ids:
            raise InvalidRequest("append needs text or token_ids")
        ids = list(request.token_ids)

        def submit(engine: Engine) -> Any:
            check_token_ids(engine, ids, "token_ids")
            return engine.submit(
                sid, text=request.text or None, token_ids=ids or None, generate=False, role=request.role or None
            )

        async with contextlib.aclosing(stream_append(self.s, submit)) as events:
            async for event in events:
                if isinstance(event, PrefillProgress):
                    progress = pb.AppendProgress(tokens_done=event.done, tokens_total=event.total)
                    yield pb.AppendContextResponse(progress=progress)
                else:
                    n = await self.s.worker.call(lambda e: len(e.session(sid).tokens))
                    done = pb.AppendSummary(tokens_added=event.tokens_added, prefill_s=event.prefill_s, num_tokens=n)
                    yield pb.AppendContextResponse(done=done)

    async def Generate(
        self, request: pb.GenerateRequest, context: Any, caller: Caller
    ) -> AsyncIterator[pb.GenerateResponse]:
        self.s.accepting()
        sid = await self.s.owned(caller, request.session_id)
        if request.prompt and request.prompt_token_ids:
            raise InvalidRequest("give prompt or prompt_token_ids, not both")
        ids = list(request.prompt_token_ids)
        limit = self.s.config.max_tokens_limit

        def submit(engine: Engine) -> Any:
            params = sampling_from(engine.session(sid).sampling, request.sampling, limit)
            return engine.submit(sid, generate=True, params=params)

        append = None
        if request.prompt or ids:
            # As `Engine.generate`: append the prompt first, so that (append T; generate) and
            # (generate T) feed the same tokens in the same chunks. The generation is chained
            # to the append: submitted on the engine thread at the step that ends it.
            def append(engine: Engine) -> Any:
                session = engine.session(sid)
                if session.busy:
                    raise SessionBusy(f"session {sid} already has a request in flight")
                sampling_from(session.sampling, request.sampling, limit)  # refuse before appending
                check_token_ids(engine, ids, "prompt_token_ids")
                return engine.submit(sid, text=request.prompt or None, token_ids=ids or None, generate=False)

        async with contextlib.aclosing(stream_generation(self.s, sid, submit, append)) as stream:
            async for item in stream:
                if isinstance(item, Finished):
                    yield pb.GenerateResponse(done=item.summary)
                else:
                    yield pb.GenerateResponse(delta=item)

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
