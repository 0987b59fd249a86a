"""Prefill beside decode: a long prompt's forward runs in pieces between the decode steps of the
other sessions, so that a stream decoding beside a 128K append waits a bounded time per token.

A chunk long enough for the layer-by-layer path (`CausalLM.is_long`: more tokens than one slice
of the MLP, 4,096 for an 8B model) does not join the step's batch. Its plan is made as any
other's (allocations, the path), its forward starts (`ModelRunner.begin`) and each `Engine.step`
first runs the batch of everything else (one token per decoding request, short prefill chunks)
and then the long forward's pieces, one after another, for at most `prefill_step_ms` of the
device's time: after the projections of a layer, after each group of KV heads' attention
(`DecoderLayer.stages`; one KV head per piece at 128K tokens of an 8B model), after each
slice's MLP. The arithmetic is that of the one-chunk path run in one go (the
same calls in the same order), and the chunk attends to its own K/V as computed: nothing it
wrote is read back over PCIe. A decoding stream therefore waits about `prefill_step_ms` plus its
own step per token, and the prefill runs for `prefill_step_ms` of every `prefill_step_ms` plus a
decode step (docs/OPERATIONS.md, "A long prompt beside decoding streams").

One long forward is in flight at a time (its activations are the size of its prompt); other
long chunks wait their turn, short ones run in the batch. While it is in flight its sequence's
blocks never move (`KVCache.frozen`). Cancelling the request or closing its session abandons
it: the session's KV ends where the chunk started, its tokens stay in its log.

Owner: the forward in flight and the clock of its budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from h3d.engine.runner import LongForward, ModelRunner
from h3d.engine.session import Request
from h3d.engine.step import Chunk, SchedulerOutput, StepReport


@dataclass(slots=True)
class LongPrefill:
    """The long chunk in flight: its request, the chunk, and its forward."""

    request: Request
    chunk: Chunk
    forward: LongForward
    layers: int  # the model's layers

    @property
    def layers_done(self) -> int:
        fwd = self.forward
        return self.layers if fwd.hidden is not None else max(0, fwd.step.layers_written - 1)

    @property
    def out(self) -> SchedulerOutput:
        return SchedulerOutput((self.chunk,), (self.request,))

    def tokens_done(self) -> int:
        """Of the chunk's tokens, the share its finished layers stand for."""
        return len(self.chunk.token_ids) * self.layers_done // self.layers


class Interleave:
    """Runs the long chunk in flight in pieces within a budget of the device's time per step."""

    def __init__(self, runner: ModelRunner, step_ms: float, clock: Callable[[], float] = time.perf_counter) -> None:
        self.runner = runner
        self.step_s = step_ms / 1000
        self.clock = clock  # tests: a fake one
        self.current: LongPrefill | None = None
        self.pieces_total = 0  # pieces run (metrics, tests)
        self.pauses = 0  # times a long forward gave the engine back before it was done

    def start(self, request: Request, chunk: Chunk, forward: LongForward) -> None:
        assert self.current is None
        layers = self.runner.model.config.num_layers
        self.current = LongPrefill(request, chunk, forward, layers)

    def holds(self, request: Request) -> bool:
        return self.current is not None and self.current.request is request

    def run(self) -> StepReport | None:
        """Run pieces of the forward in flight until it is done (its report, for the commit) or
        the next piece would end past the budget (None: it goes on at the next step). At least one
        piece runs. On a GPU the host stays one piece ahead of the device: it queues a piece, then
        waits for the one before it, so that the device never idles while the host prepares the
        next (a wait for each piece left the device idle between pieces, 544 times in a 128K
        prefill of an 8B model), and the budget counts the piece still in flight when it stops: a
        decode step queued after it waits for at most the budget. On the CPU each piece has run
        when the call returns."""
        prefill = self.current
        assert prefill is not None
        runner, fwd = self.runner, prefill.forward
        began = last = self.clock()
        longest = 0.0  # the longest piece so far this step: the guess for the next one
        behind = None  # (GPU) the piece before the one just queued
        while True:
            t0 = self.clock()
            try:
                done = runner.advance(fwd)  # a failure abandons the forward (and propagates)
            except BaseException:
                self.current = None
                raise
            self.pieces_total += 1
            if done:
                self.current = None
                return runner.finish(fwd)
            queued = runner.mark()
            if queued is None:  # it ran as it was called
                t1 = self.clock()
                longest, ahead = max(longest, t1 - t0), 0.0
            else:  # the device works on this piece while the host waits for the one before
                if behind is not None:
                    behind.synchronize()
                t1 = self.clock()
                longest, last, behind = max(longest, t1 - last), t1, queued
                ahead = longest  # this piece, still in flight
            if t1 - began + ahead + longest > self.step_s:
                self.pauses += 1
                return None

    def abandon(self) -> None:
        """Drop the forward in flight, if any (its request's session keeps its tokens)."""
        prefill, self.current = self.current, None
        if prefill is not None:
            self.runner.abandon(prefill.forward)
