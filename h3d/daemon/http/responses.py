"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: stored responses are sessions.

A response that starts a conversation opens a chat session (its `instructions` the system
message); a response with `previous_response_id` continues that response's session in place, so
that only the new messages are prefilled (`usage.input_tokens_details.cached_tokens`: the tokens
whose KV the session already held). Only the latest response of a conversation continues it in
place; an earlier one (or any with `store: false`) continues a fork of the session as it stood at
that response's end (`Engine.fork_session`: its KV blocks shared, its last tokens computed again), a new
session that later responses continue.

Each stored response is a record in its session's `extra` (the token log: it lives as long as the
session, through `session_ttl_s` closes and restarts, and goes with a purge): its id, where its
output lies in the session's tokens (`start`, `end`, `chars`: the text is decoded from them), its
usage, status and parameters. `ResponseIndex` maps ids to sessions on the event loop; it is
rebuilt from the sessions at start. A response with `store: false` runs on a session of its own,
deleted once it is answered. A turn that fails after its messages went in (a disconnect, a drain)
is recorded with its status, so that the conversation goes on from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from aiohttp import web

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.auth import Caller
from h3d.daemon.generation import stream_append, stream_generation
from h3d.daemon.http.completions import Sampling, open_sse, send, send_error
from h3d.daemon.http.schemas import (
    ContentPartEvent,
    Deleted,
    IncompleteDetails,
    InputTokensDetails,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    Response,
    ResponseEvent,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from h3d.daemon.http.server import json_response
from h3d.daemon.status import Conflict, NotFound
from h3d.daemon.worker import Finished
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import RequestId, SessionId
from h3d.errors import H3Error, NoChatTemplate, SessionBusy, SessionNotFound, clip

if TYPE_CHECKING:
    from h3d.daemon.http.server import HttpApi

KEY = "responses"  # the key of a session's `extra` that holds its responses
E = TypeVar("E", bound=StreamEvent)


@dataclass(slots=True)
class Turn:
    """What a response's turn knows once its messages are in, before it generates."""

    sid: SessionId
    owner: str
    new: bool  # the session was made for this response
    history: int  # tokens of the context before this turn
    cached: int  # of those, tokens whose KV the session held (or got from a cached prefix: `count`)

    def count(self, engine: Engine, reused: int) -> None:
        """After an append's submit: if it shared KV blocks of a cached prefix (`share_prefixes`: the
        engine's reused tokens grew past `reused`), that KV is what the turn did not compute."""
        if engine.counters.prefix_reused_tokens > reused:
            self.cached = engine.cached_tokens(self.sid)


class ResponseIndex:
    """Response id -> (owner, session), on the event loop; rebuilt from the sessions at start."""

    def __init__(self) -> None:
        self.sessions: dict[str, tuple[str, SessionId]] = {}

    def load(self, engine: Engine) -> int:
        for session in engine.sessions.values():
            for record in session.extra.get(KEY, ()):
                self.sessions[str(record["id"])] = (session.owner, session.id)
        return len(self.sessions)

    def find(self, caller: Caller, rid: str, param: str | None = None) -> SessionId:
        found = self.sessions.get(rid)
        if found is None or (found[0] != caller.owner and not caller.admin):
            raise NotFound(f"no stored response {clip(rid)!r}", param=param, code="response_not_found")
        return found[1]


class Responses:
    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.s = api.s
        self.index = ResponseIndex()
        self.turns: set[SessionId] = set()  # conversations with a response in progress (on the loop)

    # ---- POST /v1/responses ------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await self.api.body(request, ResponsesRequest)
        caller = self.api.caller(request)
        self.s.accepting()
        messages = body.messages()
        prev_sid = None
        if body.previous_response_id is not None:
            prev_sid = self.index.find(caller, body.previous_response_id, "previous_response_id")
            if prev_sid in self.turns:  # its messages go in one by one: nothing may come between them
                raise Conflict(f"the conversation of {body.previous_response_id} has a response in progress",
                               param="previous_response_id", code="conversation_busy")  # fmt: skip
        if body.instructions:
            messages.insert(0, {"role": "system", "content": body.instructions})
        sampling = Sampling(
            max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            seed=body.seed, stop=(), presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, ignore_eos=body.ignore_eos,
        )  # fmt: skip
        limit = self.s.config.max_tokens_limit
        previous = body.previous_response_id

        def begin(engine: Engine) -> tuple[Turn, Any]:
            params = sampling.apply(engine.with_sampling(), limit)  # (a chat session's end of turn: the engine's)
            if prev_sid is None:
                if engine.tokenizer.chat_template is None:
                    raise NoChatTemplate("this model has no chat template: the Responses API needs one")
                sid = engine.create_session(sampling=params, owner=caller.owner, chat=True)
                return Turn(sid, caller.owner, True, 0, 0), params
            session = engine.session(prev_sid)
            if session.busy:
                raise SessionBusy(f"the conversation of {previous} has a response in progress")
            records = session.extra.get(KEY, [])
            latest = bool(records) and records[-1]["id"] == previous and records[-1]["end"] == len(session.tokens)
            if latest and body.store:  # continued in place
                cached = engine.kv.cached_tokens(session.seq)
                return Turn(session.id, session.owner, False, len(session.tokens), cached), params
            # An earlier response, or one continued on the side (store: false): a fork of the
            # conversation as it stood at that response's end (its KV blocks shared, not computed again).
            end = next((int(r["end"]) for r in records if r["id"] == previous), None)
            if end is None:
                raise NotFound(f"no stored response {clip(previous or '')!r}", param="previous_response_id",
                               code="response_not_found")  # fmt: skip
            sid = engine.fork_session(session.id, end, owner=session.owner)
            fork = engine.session(sid)
            return Turn(sid, session.owner, True, len(fork.tokens), engine.kv.cached_tokens(fork.seq)), params

        if prev_sid is not None:
            self.turns.add(prev_sid)
        try:
            turn, params = await self.s.worker.call(begin)
        except BaseException:
            self.turns.discard(prev_sid)
            raise
        if prev_sid is not None and turn.sid != prev_sid:  # a fork: its parent's conversation is free again
            self.turns.discard(prev_sid)
        self.turns.add(turn.sid)
        try:
            return await self._turn(request, body, caller, turn, params, messages)
        finally:
            self.turns.discard(turn.sid)

    async def _turn(
        self,
        request: web.Request,
        body: ResponsesRequest,
        caller: Caller,
        turn: Turn,
        params: SamplingParams,
        messages: list[dict[str, str]],
    ) -> web.StreamResponse:
        previous = body.previous_response_id
        request["session_id"] = turn.sid
        if turn.new and body.store:
            self.s.owners[turn.sid] = caller.owner  # listed in gRPC too: a stored conversation is a session
        rid = f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        record: dict[str, Any] = {
            "id": rid, "created_at": created, "start": turn.history, "end": turn.history, "chars": 0,
            "status": "in_progress", "finish": None, "input_tokens": 0, "output_tokens": 0, "cached_tokens": 0,
            "instructions": body.instructions, "temperature": params.temperature, "top_p": params.top_p,
            "max_output_tokens": body.max_output_tokens, "previous_response_id": previous,
            "metadata": body.metadata or {}, "user": body.user, "store": body.store,
        }  # fmt: skip
        try:
            for message in messages[:-1]:
                await self._append(turn, message)
            last = messages[-1]

            def append(engine: Engine) -> RequestId:
                reused = engine.counters.prefix_reused_tokens
                made = engine.submit(turn.sid, text=last["content"], role=last["role"], generate=False)
                turn.count(engine, reused)
                return made

            def submit(engine: Engine) -> RequestId:
                made = engine.submit(turn.sid, generate=True, params=params)
                record["start"] = len(engine.session(turn.sid).tokens)  # past the turn's header, appended by the submit
                return made

            stream = stream_generation(self.s, turn.sid, submit, append)
            if body.stream:
                return await self._sse(request, stream, record, turn)
            texts: list[str] = []
            async with contextlib.aclosing(stream) as events:
                async for item in events:
                    if isinstance(item, Finished):
                        text = "".join(texts)
                        await self._finish(turn, record, item.summary, text)
                        return json_response(self.response_object(record, text))
                    texts.append(item.text)
            raise AssertionError("a generation ended without its end")  # pragma: no cover
        except BaseException:
            if record["status"] == "in_progress" and body.store:
                await self._failed(turn, record)
            raise
        finally:
            if not body.store:  # (its KV kept for prefix reuse)
                self.s.worker.post(lambda engine: engine.retire(turn.sid))

    async def _append(self, turn: Turn, message: dict[str, str]) -> None:
        """One message into a chat session, waited for (a turn's messages before its last)."""

        def submit(engine: Engine) -> RequestId:
            reused = engine.counters.prefix_reused_tokens
            made = engine.submit(turn.sid, text=message["content"], role=message["role"], generate=False)
            turn.count(engine, reused)
            return made

        async with contextlib.aclosing(stream_append(self.s, submit)) as events:
            async for _ in events:  # its progress: nobody reads it here
                pass

    async def _sse(
        self, request: web.Request, stream: AsyncIterator[pb.TokenDelta | Finished], record: dict[str, Any], turn: Turn
    ) -> web.StreamResponse:
        seq = 0
        msg_id = f"msg_{record['id'][5:]}"
        place = {"item_id": msg_id, "output_index": 0, "content_index": 0}

        async def event(kind: type[E], **fields: Any) -> None:
            nonlocal seq
            body = kind(sequence_number=seq, **fields)
            await send(response, body, event=body.type)
            seq += 1

        async with contextlib.aclosing(stream) as events:  # type: ignore[type-var]
            items = aiter(events)
            item = await anext(items)  # a refusal before the first token is an HTTP status, not an event
            response = await open_sse(request)
            texts: list[str] = []
            try:
                begun = self.response_object(record, "")
                await event(ResponseEvent, type="response.created", response=begun)
                await event(ResponseEvent, type="response.in_progress", response=begun)
                empty = OutputMessage(id=msg_id, status="in_progress", content=[])
                await event(OutputItemEvent, type="response.output_item.added", item=empty)
                await event(ContentPartEvent, type="response.content_part.added", **place, part=OutputText(text=""))
                while not isinstance(item, Finished):
                    if item.text:
                        texts.append(item.text)
                        await event(TextDeltaEvent, type="response.output_text.delta", **place, delta=item.text)
                    item = await anext(items)
                text = "".join(texts)
                await self._finish(turn, record, item.summary, text)
                await event(TextDoneEvent, type="response.output_text.done", **place, text=text)
                await event(ContentPartEvent, type="response.content_part.done", **place, part=OutputText(text=text))
                whole = self.response_object(record, text)
                await event(OutputItemEvent, type="response.output_item.done", item=whole.output[0])
                done = "response.completed" if record["status"] == "completed" else f"response.{record['status']}"
                await event(ResponseEvent, type=done, response=whole)
            except H3Error as exc:
                await send_error(response, exc, event="error")
        return response

    async def _finish(self, turn: Turn, record: dict[str, Any], summary: pb.GenerateSummary, text: str) -> None:
        record["status"] = "incomplete" if summary.finish_reason == pb.FINISH_REASON_LENGTH else "completed"
        if summary.finish_reason == pb.FINISH_REASON_CANCELLED:
            record["status"] = "cancelled"
        record["finish"] = pb.FinishReason.Name(summary.finish_reason)
        record["output_tokens"] = summary.completion_tokens
        record["input_tokens"] = summary.prompt_tokens
        record["cached_tokens"] = min(turn.cached, summary.prompt_tokens)
        record["chars"] = len(text)
        if record["store"]:
            await self._keep(turn, record)

    async def _failed(self, turn: Turn, record: dict[str, Any]) -> None:
        """A turn that ended without its end (refused, failed, its client gone). Where its messages
        went in, it is recorded (`failed`, its text what the session holds), so that the
        conversation goes on from it; where nothing changed, a session made for it is deleted."""
        record["status"], record["chars"] = "failed", -1
        try:
            n = await self.s.worker.call(lambda e: len(e.session(turn.sid).tokens))
            if n > turn.history:
                await asyncio.shield(self._keep(turn, record))
            elif turn.new:
                self.s.worker.post(lambda engine: engine.close_session(turn.sid, purge=True))
                self.s.owners.pop(turn.sid, None)
        except (H3Error, asyncio.CancelledError):
            pass

    async def _keep(self, turn: Turn, record: dict[str, Any]) -> None:
        """Record the response in its session's log (durable before it is answered)."""

        def keep(engine: Engine) -> Any:
            session = engine.session(turn.sid)
            record["end"] = len(session.tokens)
            engine.set_extra(turn.sid, KEY, [*session.extra.get(KEY, []), dict(record)])
            return engine.journal.sync_behind(turn.sid) if engine.journal is not None else None

        durable = await self.s.worker.call(keep)
        self.index.sessions[record["id"]] = (turn.owner, turn.sid)
        if durable is not None:
            await asyncio.wrap_future(durable)

    # ---- GET and DELETE /v1/responses/{id} ---------------------------------------------------

    async def get(self, request: web.Request) -> web.Response:
        caller = self.api.caller(request)
        rid = request.match_info["response_id"]
        sid = self.index.find(caller, rid)
        request["session_id"] = sid

        def read(engine: Engine) -> tuple[dict[str, Any], str]:
            session = engine.session(sid)
            record = next((r for r in session.extra.get(KEY, []) if r["id"] == rid), None)
            if record is None:
                raise NotFound(f"no stored response {clip(rid)!r}")
            return record, _decode(engine, session.tokens, record)

        try:
            record, text = await self.s.worker.call(read)
        except SessionNotFound:
            self.index.sessions.pop(rid, None)
            raise NotFound(f"no stored response {clip(rid)!r}") from None
        return json_response(self.response_object(record, text))

    async def delete(self, request: web.Request) -> web.Response:
        """Forget a stored response; its session goes with its last response."""
        caller = self.api.caller(request)
        rid = request.match_info["response_id"]
        sid = self.index.find(caller, rid)
        request["session_id"] = sid

        def forget(engine: Engine) -> bool:
            session = engine.session(sid)
            if session.busy:
                raise SessionBusy("the conversation has a response in progress: delete it once it ends")
            left = [r for r in session.extra.get(KEY, []) if r["id"] != rid]
            if left:
                engine.set_extra(sid, KEY, left)
                return False
            engine.close_session(sid, purge=True)
            return True

        with contextlib.suppress(SessionNotFound):
            if await self.s.worker.call(forget):
                self.s.owners.pop(sid, None)
        self.index.sessions.pop(rid, None)
        return json_response(Deleted(id=rid))

    # ---- the response object -----------------------------------------------------------------

    def response_object(self, record: dict[str, Any], text: str) -> Response:
        status = record["status"]
        output, used = [], None
        if status != "in_progress":
            done: Literal["completed", "incomplete"] = "completed" if status == "completed" else "incomplete"
            output = [OutputMessage(id=f"msg_{record['id'][5:]}", status=done, content=[OutputText(text=text)])]
            used = ResponseUsage(
                input_tokens=record["input_tokens"],
                input_tokens_details=InputTokensDetails(cached_tokens=record["cached_tokens"]),
                output_tokens=record["output_tokens"],
                total_tokens=record["input_tokens"] + record["output_tokens"],
            )
        return Response(
            id=record["id"],
            created_at=record["created_at"],
            status=status,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            instructions=record["instructions"],
            max_output_tokens=record["max_output_tokens"],
            model=self.api.model,
            output=output,
            previous_response_id=record["previous_response_id"],
            store=record.get("store", True),
            temperature=record["temperature"],
            top_p=record["top_p"],
            usage=used,
            user=record.get("user"),
            metadata=record.get("metadata") or {},
        )


def _decode(engine: Engine, tokens: list[int], record: dict[str, Any]) -> str:
    """A stored response's text: its tokens decoded, cut where its stream stopped (`chars`; -1:
    a turn that failed, all that its tokens say)."""
    text = engine.tokenizer.decode(tokens[record["start"] : record["end"]])
    return text[: record["chars"]] if record["chars"] >= 0 else text
