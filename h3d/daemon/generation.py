"""A generation (and an append) as the front ends stream it: the engine's events for one request.

Both APIs (gRPC `Generate`: h3d.daemon.service; the OpenAI HTTP API: h3d.daemon.http) run a
generation the same way: admitted within `max_pending_requests` (`State.slot`), submitted on the
engine thread (a prompt's append chained to its generation: no step boundary between them), its
token deltas coalesced where the loop fell behind the engine (one message, not one per token),
time to first token and the gaps between tokens counted (`h3d_ttft_seconds`,
`h3d_inter_token_seconds`, Stats' per-session p50/p99: a message of n tokens sent a gap after the
one before counts n gaps of gap / n each; tokens sent with the first, gaps of 0), and the request
cancelled on the engine whenever the stream ends before the generation did (the client went away,
or stopped reading).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable

import structlog

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.rpc import State
from h3d.daemon.worker import Finished
from h3d.engine.engine import Engine
from h3d.engine.session import AppendDone, Event, PrefillProgress, RequestFailed, RequestId, SessionId, TokenDelta

log = structlog.get_logger("h3d.generation")


async def stream_generation(
    state: State,
    sid: SessionId,
    submit: Callable[[Engine], RequestId],
    append: Callable[[Engine], RequestId] | None = None,
) -> AsyncGenerator[pb.TokenDelta | Finished, None]:
    """The deltas of the generation `submit` starts on `sid` (after `append`, if given), then its
    `Finished` (with `ttft_s` set: from this call, the prompt's prefill included). A failure is
    raised as its error. Close the iterator (`contextlib.aclosing`) to cancel the generation.
    Logs where its time to first token went (`generation`): waiting for a slot and the
    engine's thread, the prompt's prefill, the rest (the first decode step, the loop)."""
    started = time.perf_counter()
    with state.slot():
        if append is not None:
            rid, events = await state.worker.start_request(append, then=submit)
        else:
            rid, events = await state.worker.start_request(submit)
        queued, prefill_s = time.perf_counter() - started, 0.0
        finished = False
        first: float | None = None
        last = started
        carry: Event | Finished | None = None
        try:
            while True:
                event, carry = (carry if carry is not None else await events.get()), None
                if isinstance(event, TokenDelta):
                    # Every token already queued goes out in this message (the loop fell behind the
                    # engine: one message, not one per token); what ends the stream waits.
                    delta, n, carry = coalesce(event, events)
                    now = time.perf_counter()
                    if first is None:  # the first token's time is TTFT; those sent with it, no gap
                        state.metrics.token(now - started, first=True)
                        gaps = [0.0] * (n - 1)
                        first = now
                    else:  # n tokens `now - last` after the previous message: a gap of 1/n of it each
                        gaps = [(now - last) / n] * n
                    for gap in gaps:
                        state.metrics.token(gap, first=False)
                        state.token_gap(sid, gap)
                    last = now
                    yield delta
                elif isinstance(event, Finished):
                    finished = True
                    event.summary.ttft_s = (first or time.perf_counter()) - started
                    log.info(
                        "generation", session_id=sid, request_id=rid, queued_ms=round(queued * 1e3, 2),
                        prefill_ms=round(prefill_s * 1e3, 2), ttft_ms=round(event.summary.ttft_s * 1e3, 2),
                        prompt_tokens=event.summary.prompt_tokens, tokens=event.summary.completion_tokens,
                    )  # fmt: skip
                    yield event
                    return
                elif isinstance(event, RequestFailed):
                    finished = True
                    raise event.error
                elif isinstance(event, AppendDone):  # the prompt is in; its generation follows on the same queue
                    prefill_s = event.prefill_s
        finally:
            if not finished:
                state.worker.cancel(rid)


async def stream_append(
    state: State, submit: Callable[[Engine], RequestId]
) -> AsyncGenerator[PrefillProgress | AppendDone, None]:
    """The progress of the append `submit` starts, then its AppendDone; admitted within
    `max_pending_requests`; a failure is raised as its error. Closed early, it cancels the append."""
    with state.slot():
        rid, events = await state.worker.start_request(submit)
        finished = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, PrefillProgress):
                    yield event
                elif isinstance(event, AppendDone):
                    finished = True
                    yield event
                    return
                elif isinstance(event, RequestFailed):
                    finished = True
                    raise event.error
        finally:
            if not finished:
                state.worker.cancel(rid)


def coalesce(
    first: TokenDelta, events: asyncio.Queue[Event | Finished]
) -> tuple[pb.TokenDelta, int, Event | Finished | None]:
    """`first` and the deltas queued behind it as one message: (the message, its tokens, the
    event that stopped the draining, if one did: the caller handles it next)."""
    texts, ids = [first.text], [first.token_id]
    while not events.empty():
        event = events.get_nowait()
        if not isinstance(event, TokenDelta):
            return pb.TokenDelta(text="".join(texts), token_ids=ids), len(ids), event
        texts.append(event.text)
        ids.append(event.token_id)
    return pb.TokenDelta(text="".join(texts), token_ids=ids), len(ids), None
