"""A Generate stream sends every token already queued in one message when the event loop falls
behind the engine (h3d.daemon.generation.coalesce): the same text and ids as one message per token,
and the event that ends the stream still comes after them."""

from __future__ import annotations

import asyncio

import pytest

from h3d.daemon.generation import coalesce
from h3d.engine.session import FinishReason, GenerationDone, RequestId, SessionId, TokenDelta

RID, SID = RequestId(1), SessionId("0" * 32)
PIECES = [(101, "Hel"), (102, ""), (103, "lo"), (104, ", wor"), (105, "ld")]  # "" : a token holding text back


def _deltas() -> list[TokenDelta]:
    return [TokenDelta(RID, SID, tok, text) for tok, text in PIECES]


def _done() -> GenerationDone:
    ids = tuple(t for t, _ in PIECES)
    return GenerationDone(RID, SID, "Hello, world", ids, FinishReason.LENGTH, 3, 0.01, 100.0)


def _drain(events: list[object], arrive_together: bool) -> list[object]:
    """The messages a stream sends for `events` (deltas coalesced where they wait together)."""

    async def run() -> list[object]:
        queue: asyncio.Queue = asyncio.Queue()
        out: list[object] = []
        pending = list(events)
        carry = None
        while pending or carry is not None or not queue.empty():
            if queue.empty() and pending:  # the engine's next step: one event, or all that remain
                for e in pending[:] if arrive_together else pending[:1]:
                    queue.put_nowait(e)
                    pending.remove(e)
            event, carry = (carry if carry is not None else queue.get_nowait()), None
            if isinstance(event, TokenDelta):
                delta, n, carry = coalesce(event, queue)
                assert n == len(delta.token_ids)
                out.append((delta.text, list(delta.token_ids)))
            else:
                out.append(event)
        return out

    return asyncio.run(run())


def test_coalesced_deltas_give_the_same_text_and_ids_as_one_per_token() -> None:
    events = [*_deltas(), _done()]
    one_by_one = _drain(events, arrive_together=False)
    together = _drain(events, arrive_together=True)
    assert len(one_by_one) == 6 and len(together) == 2  # five messages and the end, or one and the end
    for messages in (one_by_one, together):
        *deltas, end = messages
        assert "".join(t for t, _ in deltas) == "Hello, world"  # type: ignore[misc]
        assert [i for _, ids in deltas for i in ids] == [101, 102, 103, 104, 105]  # type: ignore[misc]
        assert end == _done()  # the end, after every token


def test_coalescing_stops_at_the_first_event_that_is_not_a_token() -> None:
    async def run() -> None:
        queue: asyncio.Queue = asyncio.Queue()
        first, *rest = _deltas()
        for e in rest[:2]:
            queue.put_nowait(e)
        queue.put_nowait(_done())
        queue.put_nowait(rest[2])  # never reached in one drain: after the end
        delta, n, carry = coalesce(first, queue)
        assert (delta.text, list(delta.token_ids), n) == ("Hello", [101, 102, 103], 3)
        assert carry == _done() and queue.qsize() == 1
        delta, n, carry = coalesce(first, asyncio.Queue())  # nothing queued: the token alone
        assert (delta.text, n, carry) == ("Hel", 1, None)

    asyncio.run(run())


def test_a_summary_that_cannot_be_made_still_ends_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GenerateSummary is made on the engine thread with the generation's end: if making it
    fails (a bug), the stream still ends, with what the end itself says, and the thread goes on."""
    import h3d.daemon.worker as worker

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(worker, "summary_pb", broken)
    summary = worker._summary_of(object(), _done(), [])  # type: ignore[arg-type]
    assert summary.finish_reason == worker.FINISH[FinishReason.LENGTH]
    assert (summary.prompt_tokens, summary.completion_tokens) == (3, 5)


def test_the_generations_that_end_at_one_step_share_its_tier_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's tier figures (global, not per session) are taken once for all the summaries of
    a step's ends, and each summary carries them."""
    import h3d.daemon.worker as worker
    from h3d._proto.h3.v1 import h3_pb2 as pb

    taken: list[int] = []

    def tier_stats(engine: object) -> pb.TierStats:
        taken.append(1)
        return pb.TierStats(hbm_hits=7 * len(taken))

    def summary(engine: object, *, sid: str, done: object, tier_stats: pb.TierStats) -> pb.GenerateSummary:
        return pb.GenerateSummary(completion_tokens=5, tier_stats=tier_stats)

    monkeypatch.setattr(worker, "tier_stats_pb", tier_stats)
    monkeypatch.setattr(worker, "summary_pb", summary)
    step: list[pb.TierStats] = []
    ends = [worker._summary_of(object(), _done(), step) for _ in range(3)]  # type: ignore[arg-type]
    assert len(taken) == 1 and [s.tier_stats.hbm_hits for s in ends] == [7, 7, 7]
    worker._summary_of(object(), _done(), [])  # type: ignore[arg-type]  # the next step takes its own
    assert len(taken) == 2
