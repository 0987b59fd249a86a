"""`POST /v1/chat/completions` and `POST /v1/completions`: one generation each, on a session of its own.

A chat completion renders its messages through the model's chat template at once (as
`h3d generate --chat` does: the same text, tokenized as one prompt) and stops at the template's
end of turn; a completion continues its prompt (text or token ids). The session is made for the
request (with the caller as its owner, unlisted in gRPC) and deleted once the answer is out,
whatever ended it. `stream: true` answers server-sent events in OpenAI's chunk format, ending
with `data: [DONE]`; an error after the first event is sent as an event with OpenAI's error
object (the status is already out).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.convert import sampling_with
from h3d.daemon.generation import stream_generation
from h3d.daemon.http.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    Completion,
    CompletionRequest,
    Delta,
    StreamOptions,
    TextChoice,
    dump,
    error_body,
    stops,
    usage,
)
from h3d.daemon.http.server import json_response
from h3d.daemon.status import Draining, http_status_of
from h3d.daemon.worker import Finished
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import NewSession, RequestId
from h3d.errors import H3Error, InvalidRequest, NoChatTemplate

if TYPE_CHECKING:
    from h3d.daemon.http.server import HttpApi

FINISH: dict[int, str] = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True, slots=True)
class Sampling:
    """A request's sampling fields (None: the daemon's `[sampling]` default)."""

    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    presence_penalty: float | None
    frequency_penalty: float | None
    ignore_eos: bool

    def apply(self, base: SamplingParams, limit: int) -> SamplingParams:
        """`base` (the daemon's defaults) with what the request sets, checked as gRPC's are
        (`sampling_with`)."""
        over: dict[str, Any] = {
            k: v
            for k, v in (
                ("max_tokens", self.max_tokens), ("temperature", self.temperature), ("top_p", self.top_p),
                ("top_k", self.top_k), ("seed", self.seed), ("presence_penalty", self.presence_penalty),
                ("frequency_penalty", self.frequency_penalty),
            )
            if v is not None
        }  # fmt: skip
        if self.stop:
            over["stop"] = self.stop
        if self.ignore_eos:
            over["ignore_eos"] = True
        return sampling_with(base, over, limit)


def sampling_of(body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None) -> Sampling:
    return Sampling(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        seed=body.seed,
        stop=stops(body.stop),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        ignore_eos=body.ignore_eos,
    )


def with_end_of_turn(engine: Engine, params: SamplingParams) -> SamplingParams:
    """A chat generation stops at the template's end of turn (unless it ignores EOS)."""
    eot = engine.end_of_turn
    if eot is None or params.ignore_eos or eot in params.stop_token_ids:
        return params
    return replace(params, stop_token_ids=(*params.stop_token_ids, eot))


class Completions:
    def __init__(self, api: HttpApi) -> None:
        self.api = api
        self.s = api.s

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self.api.body(request, ChatCompletionRequest)
        messages = [m.as_chat() for m in body.messages]

        def prompt(engine: Engine) -> tuple[str | None, list[int] | None]:
            if engine.tokenizer.chat_template is None:
                raise NoChatTemplate("this model has no chat template: use /v1/completions with a plain prompt")
            return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True), None

        return await self._run(request, body, prompt, sampling_of(body, body.limit), chat=True)

    async def text(self, request: web.Request) -> web.StreamResponse:
        body = await self.api.body(request, CompletionRequest)
        text, ids = body.one_prompt()
        if text == "":
            raise InvalidRequest("prompt: is empty")
        return await self._run(
            request, body, lambda engine: (text, ids), sampling_of(body, body.max_tokens), chat=False
        )

    async def _run(
        self,
        request: web.Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompt: Callable[[Engine], tuple[str | None, list[int] | None]],
        sampling: Sampling,
        chat: bool,
    ) -> web.StreamResponse:
        caller = self.api.caller(request)
        self.s.accepting()
        limit = self.s.config.max_tokens_limit

        engine = self.s.worker.engine

        params = sampling.apply(engine.with_sampling(), limit)
        if chat:
            params = with_end_of_turn(engine, params)
        text: str | None = None
        ids: list[int] | None = None

        def prepare() -> NewSession:
            # Off the engine's thread (the configuration and the tokenizer only): the session is
            # taken in at the step boundary where its append starts, not one before.
            nonlocal text, ids
            text, ids = prompt(engine)
            return engine.prepare_session(sampling=params, owner=caller.owner)

        sid = (await self.s.make_session(prepare)).session.id
        request["session_id"] = sid
        try:
            reused = [0]  # tokens whose KV came from another session (`share_prefixes`)

            def append(engine: Engine) -> RequestId:
                made = engine.submit(sid, text=text, token_ids=ids, generate=False)
                reused[0] = engine.cached_tokens(sid)
                return made

            def submit(engine: Engine) -> RequestId:
                return engine.submit(sid, generate=True, params=params)

            stream = stream_generation(self.s, sid, submit, append)
            name = self.api.model
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{sid}"
            created = int(time.time())
            if body.stream:
                return await self._sse(request, stream, rid, created, name, chat, body.stream_options, reused)
            texts: list[str] = []
            async with contextlib.aclosing(stream) as events:
                async for item in events:
                    if isinstance(item, Finished):
                        s = item.summary
                        finish = finish_of(s.finish_reason)
                        used = usage(s.prompt_tokens, s.completion_tokens, reused[0])
                        out = "".join(texts)
                        reply: BaseModel
                        if chat:
                            message = AssistantMessage(content=out)
                            choice = ChatChoice(message=message, finish_reason=finish)
                            reply = ChatCompletion(id=rid, created=created, model=name, choices=[choice], usage=used)
                        else:
                            choices = [TextChoice(text=out, finish_reason=finish)]
                            reply = Completion(id=rid, created=created, model=name, choices=choices, usage=used)
                        return json_response(reply)
                    texts.append(item.text)
            raise AssertionError("a generation ended without its end")  # pragma: no cover
        finally:
            self.s.worker.post(lambda engine: engine.retire(sid))  # its KV kept for prefix reuse

    async def _sse(
        self,
        request: web.Request,
        stream: AsyncIterator[pb.TokenDelta | Finished],
        rid: str,
        created: int,
        name: str,
        chat: bool,
        options: StreamOptions | None,
        reused: list[int],
    ) -> web.StreamResponse:
        with_usage = options is not None and options.include_usage

        def chunk(text: str | None, finish: str | None, role: bool = False) -> BaseModel:
            if chat:
                delta = Delta(role="assistant", content="") if role else Delta(content=text)
                choice = ChunkChoice(delta=delta, finish_reason=finish)
                return ChatCompletionChunk(id=rid, created=created, model=name, choices=[choice])
            return Completion(
                id=rid, created=created, model=name, choices=[TextChoice(text=text or "", finish_reason=finish)]
            )

        async def write(model: BaseModel) -> None:
            await response.write(b"data: " + dump(model, usage=with_usage).encode() + b"\n\n")

        async with contextlib.aclosing(stream) as events:  # type: ignore[type-var]
            items = aiter(events)
            item = await anext(items)  # a refusal before the first token is an HTTP status, not an event
            response = await open_sse(request)
            try:
                if chat:
                    await write(chunk(None, None, role=True))
                while True:
                    if isinstance(item, Finished):
                        s = item.summary
                        await write(chunk(None, finish_of(s.finish_reason)))
                        if with_usage:  # one more chunk: no choices, the usage
                            used = usage(s.prompt_tokens, s.completion_tokens, reused[0])
                            kind = ChatCompletionChunk if chat else Completion
                            await write(kind(id=rid, created=created, model=name, choices=[], usage=used))
                        await response.write(b"data: [DONE]\n\n")
                        return response
                    if item.text:
                        await write(chunk(item.text, None))
                    item = await anext(items)
            except H3Error as exc:
                await send_error(response, exc)
        return response


def finish_of(reason: int) -> str:
    """OpenAI's finish_reason; a generation cancelled by the daemon (a drain) is an error."""
    if reason == pb.FINISH_REASON_CANCELLED:
        raise Draining("the daemon is draining: the generation was cancelled")
    return FINISH.get(reason, "stop")


async def open_sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    await response.prepare(request)
    return response


async def send(response: web.StreamResponse, body: BaseModel, event: str | None = None) -> None:
    """One server-sent event: `data:` the body's JSON, after `event:` where it is named."""
    head = f"event: {event}\n" if event else ""
    await response.write(f"{head}data: {dump(body)}\n\n".encode())


async def send_error(response: web.StreamResponse, exc: H3Error, event: str | None = None) -> None:
    """An error after the stream's status went out: one event with OpenAI's error object."""
    _, kind, code = http_status_of(exc)
    with contextlib.suppress(ConnectionError):
        await send(response, error_body(str(exc), kind, getattr(exc, "param", None), code), event)
