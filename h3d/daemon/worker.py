"""The engine's own thread: the only code that touches the `Engine` once the daemon runs.

The event loop (gRPC handlers) never blocks on the model. It hands the worker *commands* (a
function of the engine, run between two steps, whose result comes back as an awaited future) and
*requests* (a submit whose events come back on an asyncio queue, one per request). The worker
runs commands, then one `engine.step()` (which batches every request in flight), and posts the
step's events to the loop with `call_soon_threadsafe`. A generation's end goes out as `Finished`,
with its GenerateSummary made on this thread at the step that ended it: the handler answers
without a command, so without waiting for another step boundary.

Owner: the engine thread, the per-request event queues, and the throughput window.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.collector import Collector
from h3d.daemon.convert import FINISH, summary_pb, tier_stats_pb
from h3d.engine.engine import Engine
from h3d.engine.session import AppendDone, Event, GenerationDone, RequestFailed, RequestId, SessionId
from h3d.errors import H3Error, LogNotDurable, RemoteError
from h3d.kernels import loader

T = TypeVar("T")
THROUGHPUT_WINDOW_S = 10.0
IDLE_WAIT_S = 0.05
WRITE_BEHIND_WAIT_S = 0.005  # idle with write-behind or read-ahead under way: their work is applied this often
SLOW_STEP_S = 1.0  # a step (with its upkeep) this long is logged (`slow_step`), with where its time went
CAPTURE_IDLE_S = 1.0  # idle this long, the engine captures the decode graphs steps wanted (not between two requests)

READ_AHEAD_EVENTS = ("read_ahead_first", "read_ahead_done")  # informational, as a resume's others

log = structlog.get_logger("h3d.worker")


@dataclass(frozen=True, slots=True)
class Finished:
    """A GenerationDone as its stream receives it: with the GenerateSummary of that moment (the
    session's residency and the tiers' counters; `ttft_s` is the handler's to set)."""

    done: GenerationDone
    summary: pb.GenerateSummary


class InternalFault(H3Error):
    """The engine failed unexpectedly (a bug); the daemon logged the traceback."""


class EngineWorker:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self._loop = loop
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], Any], asyncio.Future[Any] | None]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self._streams: dict[RequestId, asyncio.Queue[Event | Finished]] = {}
        self._then: dict[RequestId, Callable[[Engine], RequestId]] = {}  # an append -> what follows its end
        self._chained: dict[RequestId, RequestId] = {}  # a chain's first request -> its second, while live
        self._heads: dict[RequestId, RequestId] = {}  # and back
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="h3d-engine", daemon=True)
        self._tokens: deque[tuple[float, int]] = deque()  # (time, generated tokens) per step
        self._busy_at = 0.0  # when the engine thread last ran a step
        self._started_at = time.monotonic()
        self._warm_captured: list[float] = []  # ms of each warm-set graph captured after ready, until all are
        self.collector = Collector()  # Python's GC between steps (`Collector.start`: the daemon's choice)
        # A generation's end waits for its log's fsync on the store's thread, not on this one's step
        # (every stream of the step would wait for the disk): `_dispatch` sends it once durable.
        engine.sync_on_finish = False

    # ---- the loop's side --------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; return (or raise) its result."""
        future: asyncio.Future[T] = self._loop.create_future()
        self._commands.put((fn, future))
        self._wake.set()
        return await future

    async def start_request(
        self, submit: Callable[[Engine], RequestId], then: Callable[[Engine], RequestId] | None = None
    ) -> tuple[RequestId, asyncio.Queue[Event | Finished]]:
        """Submit a request (`submit` calls `engine.submit`); its events arrive on the queue, the
        last one a `Finished` (a generation's end), AppendDone or RequestFailed.

        `then` chains a second request to an append: it is submitted on the engine thread at the
        step that ends the append, before the next step, and its events follow the AppendDone on
        the same queue (a prompt and its generation without a step boundary between them, as a
        caller of the engine would submit them). If `then` fails, a RequestFailed follows the
        AppendDone. `cancel` with the first request's id cancels whichever of the two is live."""
        events: asyncio.Queue[Event | Finished] = asyncio.Queue()
        made: list[RequestId] = []

        def run(engine: Engine) -> RequestId:
            rid = submit(engine)
            self._streams[rid] = events  # before any step can produce its events
            if then is not None:
                self._then[rid] = then
            made.append(rid)
            return rid

        try:
            return await self.call(run), events
        except asyncio.CancelledError:
            # The client left while the submit was queued: cancel what it created (commands run
            # in order, so this runs after it).
            self._commands.put((lambda engine: cancel_all(engine, made), None))
            self._wake.set()
            raise

    def post(self, fn: Callable[[Engine], Any]) -> None:
        """Run `fn(engine)` on the engine thread between steps, without waiting for it: commands
        run in the order they came, so every later command sees what it did. A failure is logged."""
        self._commands.put((fn, None))
        self._wake.set()

    def cancel(self, rid: RequestId) -> None:
        """Cancel a request (its client went away): it ends at the next step, freeing its slot.
        A chain (`start_request`'s `then`) is cancelled by its first request's id."""
        self.post(lambda engine: self._cancel(engine, rid))

    def _cancel_chain(self, rid: RequestId, engine: Engine) -> None:
        """Cancel the chain `rid` is part of (by its first request's id)."""
        self._cancel(engine, self._heads.get(rid, rid))

    def _cancel(self, engine: Engine, rid: RequestId) -> None:
        self._then.pop(rid, None)  # an append cancelled before its end chains nothing
        engine.cancel(self._chained.get(rid, rid))

    def throughput(self) -> float:
        """Generated tokens per second over the last THROUGHPUT_WINDOW_S seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._tokens) if t > now - THROUGHPUT_WINDOW_S]
        return sum(n for _, n in recent) / THROUGHPUT_WINDOW_S

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the commands queued so far (requests in flight must have ended)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine thread ------------------------------------------------------------------

    def _report(self) -> None:
        """Log what the engine noted outside the request flow: KV rebuilt, the SSD tier's health,
        closed sessions' KV evicted for ssd_capacity_mb."""
        engine = self.engine
        for reason in engine.rebuilds:
            log.warning("kv_rebuild", reason=reason)
        engine.rebuilds.clear()
        for sid in engine.evictions:
            log.info("kv_evicted_for_capacity", session_id=sid)
        engine.evictions.clear()
        graphs = engine.runner.graphs
        for key in engine.captured:
            ms = round(graphs.capture_s.get(key, 0.0) * 1e3, 1)
            if key in graphs.warm_keys:  # the warm set's left for after ready: logged once, all captured
                self._warm_captured.append(ms)
                continue
            log.info("graph_captured", batch=key.batch, width=key.width, k=key.k, mixed=key.mixed,
                     after_ready=True, ahead=key in graphs.ahead_keys, ms=ms)  # fmt: skip
        engine.captured.clear()
        if self._warm_captured and not graphs.warm_waiting:
            log.info("graphs_warmed", graphs=len(self._warm_captured),
                     capture_s=round(sum(self._warm_captured) / 1e3, 3),
                     after_ready_s=round(time.monotonic() - self._started_at, 3))  # fmt: skip
            self._warm_captured = []
        for name, fields in engine.kv.take_notices():
            quiet = name in ("ssd_recovered", "digests_restored", "session_forked", *READ_AHEAD_EVENTS)
            (log.info if quiet else log.warning)(name, **fields)

    def _run(self) -> None:
        while True:
            self._run_commands()
            self._report()
            self._dispatch(self.engine.take_events())
            if self._stop:
                return
            if not self.engine.has_work:
                self.collector.due()
                graphs = self.engine.runner.graphs
                capture = bool(graphs.deferred) and time.monotonic() - self._busy_at >= CAPTURE_IDLE_S
                if capture:
                    # graphs that steps wanted, or the warm set's left for after ready: one a turn,
                    # so that a request that comes meanwhile waits for one capture at most
                    self.engine.upkeep(idle=True)
                more = self.engine.write_behind()  # dirty KV past its budget, unbounded per call while idle
                more = self.engine.read_ahead() or more  # resumed sessions' archived KV back into DDR
                if capture and graphs.deferred:
                    continue  # the next capture at once
                self._wake.wait(WRITE_BEHIND_WAIT_S if more else IDLE_WAIT_S)
                self._wake.clear()
                continue
            before = self.engine.counters.generated_tokens
            self._busy_at = time.monotonic()
            t0 = time.perf_counter()
            upkeep_s = 0.0
            compiles, compile_s = loader.COMPILES.count, loader.COMPILES.seconds
            try:
                self.engine.upkeep()
                upkeep_s = time.perf_counter() - t0
                events = self.engine.step()
            except Exception:
                # A bug: fail every request in flight rather than spin on it; the daemon goes on.
                log.exception("engine_step_failed")
                fault = InternalFault("internal error in the engine; the daemon's log has the details")
                events = [self.engine._fail(req, fault) for req in list(self.engine.requests().values())]
                for event in events:
                    _drop_unsampled_kv(self.engine, event.session_id)
            if self.engine.journal is not None:
                self.engine.journal.sync_due(behind=True)  # group commit of the token logs, on their thread
            self._report()
            made = self.engine.counters.generated_tokens - before
            if made:
                now = time.monotonic()
                self._tokens.append((now, made))
                while self._tokens and self._tokens[0][0] < now - THROUGHPUT_WINDOW_S:
                    self._tokens.popleft()
            self._dispatch(events)
            took = time.perf_counter() - t0
            if took >= SLOW_STEP_S:
                t = self.engine.timing
                log.warning("slow_step", ms=round(took * 1e3, 1), upkeep_ms=round(upkeep_s * 1e3, 1),
                            chunks=t.chunks, batch_ms=round(t.batch_s * 1e3, 1), long_pieces=t.pieces,
                            long_ms=round(t.long_s * 1e3, 1), **(t.host.fields() if t.host else {}),
                            kernel_compiles=loader.COMPILES.count - compiles,
                            compile_ms=round((loader.COMPILES.seconds - compile_s) * 1e3, 1))  # fmt: skip
            self.collector.due()  # between steps, never during one

    def _run_commands(self) -> None:
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(self.engine)
            except BaseException as exc:
                if future is not None:
                    self._loop.call_soon_threadsafe(_settle, future, None, exc)
                elif not isinstance(exc, H3Error):
                    log.exception("engine_command_failed")
                continue
            if future is not None:
                self._loop.call_soon_threadsafe(_settle, future, result, None)

    def _dispatch(self, events: list[Event]) -> None:
        """Hand a step's events to their streams: one wake-up of the loop per step, not per event.
        The tokens go first; then the sessions' metadata is written (`Engine.save_touched`); the
        ends of generations follow with their summaries (tier figures read once for the step), each
        once its token log is durable."""
        batch: list[tuple[asyncio.Queue[Event | Finished], Event | Finished]] = []
        ends: list[tuple[asyncio.Queue[Event | Finished], GenerationDone]] = []
        for event in events:
            done = isinstance(event, GenerationDone | AppendDone | RequestFailed)
            stream = self._streams.pop(event.request_id, None) if done else self._streams.get(event.request_id)
            then = self._then.pop(event.request_id, None) if done else None
            if done:
                self._chain_ended(event.request_id)
            if stream is None:
                continue
            if isinstance(event, GenerationDone):
                ends.append((stream, event))
            else:
                batch.append((stream, event))
            if then is not None and isinstance(event, AppendDone):
                failed = self._chain(event, then, stream)
                if failed is not None:
                    batch.append((stream, failed))
        if batch:
            self._deliver_held(batch)
        # The ended requests' metadata, once their last tokens are out, and before the fsyncs that
        # the ends wait for (which then cover it).
        self.engine.save_touched()
        if not ends:
            return
        now: list[tuple[asyncio.Queue[Event | Finished], Event | Finished]] = []
        tiers: list[pb.TierStats] = []
        for stream, end in ends:  # (scheduled after the batch: a stream's tokens before its end)
            finished = Finished(end, _summary_of(self.engine, end, tiers))
            durable = self._durable(end.session_id)
            if durable is None:
                now.append((stream, finished))
            else:
                durable.add_done_callback(functools.partial(self._when_durable, stream, finished))
        if now:
            self._loop.call_soon_threadsafe(_deliver, now)

    def _deliver_held(self, batch: list[tuple[asyncio.Queue[Event | Finished], Event | Finished]]) -> None:
        """Deliver a step's events; with the remote tier in `sync` mode, each session's only once
        the store holds its log as it is now (`RemoteLogs.durable`): a token is never shown before
        the store has it. A store that does not take it in time ends the stream (UNAVAILABLE)."""
        remote, journal = self.engine.remote, self.engine.journal
        if remote is None or not remote.sync or journal is None:
            self._loop.call_soon_threadsafe(_deliver, batch)
            return
        now: list[tuple[asyncio.Queue[Event | Finished], Event | Finished]] = []
        held: dict[SessionId, list[tuple[asyncio.Queue[Event | Finished], Event | Finished]]] = {}
        for item in batch:
            sid: SessionId = getattr(item[1], "session_id")  # noqa: B009 (every event of a step names it)
            if journal.size(sid):
                held.setdefault(sid, []).append(item)
            else:
                now.append(item)
        for sid, items in held.items():
            future = remote.durable(sid, journal.size(sid))
            if future.done() and future.exception() is None:
                now += items
            else:
                future.add_done_callback(functools.partial(self._when_stored, items))
        if now:
            self._loop.call_soon_threadsafe(_deliver, now)

    def _when_stored(
        self, items: list[tuple[asyncio.Queue[Event | Finished], Event | Finished]], stored: Future[None]
    ) -> None:
        """The store's thread: a step's events of one session, once the store holds its log (or
        each stream's end, UNAVAILABLE, if it did not in time)."""
        error = stored.exception()
        out: list[tuple[asyncio.Queue[Event | Finished], Event | Finished]] = items
        if error is not None:
            cause = error if isinstance(error, H3Error) else InternalFault(f"the remote store failed: {error}")
            ended: dict[int, tuple[asyncio.Queue[Event | Finished], Event | Finished]] = {}
            for stream, event in items:
                e: Any = event
                if id(stream) not in ended:  # its request stops too (the stream's end is this failure)
                    self.post(functools.partial(self._cancel_chain, e.request_id))
                ended.setdefault(id(stream), (stream, RequestFailed(e.request_id, e.session_id, cause)))
            out = list(ended.values())
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is gone
            self._loop.call_soon_threadsafe(_deliver, out)

    def _durable(self, session_id: SessionId) -> Future[None] | None:
        """The fsync of `session_id`'s log on the store's thread (`TokenStore.sync_behind`), and
        with the remote tier in `sync` mode the store's acknowledgement of it too; None where
        there is nothing to wait for."""
        journal = self.engine.journal
        if journal is None:
            return None
        future = journal.sync_behind(session_id)
        remote = self.engine.remote
        if remote is not None and remote.sync and journal.size(session_id):
            future = _both(future, remote.durable(session_id, journal.size(session_id)))
        return None if future.done() and future.exception() is None else future

    def _when_durable(self, stream: asyncio.Queue[Event | Finished], finished: Finished, durable: Future[None]) -> None:
        """The store's thread: a generation's log is durable (or its fsync failed: the stream ends
        with that error, after every token it streamed)."""
        error = durable.exception()
        event: Event | Finished = finished
        if error is not None:
            done = finished.done
            log.error("token_log_not_durable", session_id=done.session_id, error=str(error))
            if isinstance(error, RemoteError):  # (the remote store's: it says what it is)
                cause: H3Error = error
            else:
                cause = LogNotDurable(f"the session's token log could not be fsynced ({error}): its last tokens "
                                      "may be lost in a crash")  # fmt: skip
            event = RequestFailed(done.request_id, done.session_id, cause)
        with contextlib.suppress(RuntimeError):  # the loop is closed: the daemon is gone
            self._loop.call_soon_threadsafe(_deliver, [(stream, event)])

    def _chain(
        self, done: AppendDone, then: Callable[[Engine], RequestId], stream: asyncio.Queue[Event | Finished]
    ) -> RequestFailed | None:
        """Submit what follows an append that just ended, onto the append's stream; a failure is
        the stream's RequestFailed."""
        try:
            rid = then(self.engine)
        except H3Error as exc:
            return RequestFailed(done.request_id, done.session_id, exc)
        except Exception:
            log.exception("engine_command_failed")
            fault = InternalFault("internal error in the engine; the daemon's log has the details")
            return RequestFailed(done.request_id, done.session_id, fault)
        self._streams[rid] = stream
        self._chained[done.request_id] = rid
        self._heads[rid] = done.request_id
        return None

    def _chain_ended(self, rid: RequestId) -> None:
        first = self._heads.pop(rid, None)
        if first is not None:
            del self._chained[first]


def _summary_of(engine: Engine, done: GenerationDone, tiers: list[pb.TierStats]) -> pb.GenerateSummary:
    """The GenerateSummary of a generation that just ended; never fails the engine thread (a
    failure is logged and the summary goes without the session's residency and the counters).
    `tiers`: the step's tier figures once taken (empty before), shared by the generations that end
    at one step."""
    try:
        if not tiers:
            tiers.append(tier_stats_pb(engine))
        return summary_pb(engine, sid=done.session_id, done=done, tier_stats=tiers[0])
    except Exception:
        log.exception("generate_summary_failed", session_id=done.session_id)
        return pb.GenerateSummary(
            finish_reason=FINISH[done.finish_reason],
            prompt_tokens=done.prompt_tokens,
            completion_tokens=len(done.token_ids),
        )


def _both(first: Future[None], second: Future[None]) -> Future[None]:
    """A future done once both are; it fails with the first failure."""
    out: Future[None] = Future()

    def done(_: Future[None]) -> None:
        if out.done():
            return
        for f in (first, second):
            if f.done() and f.exception() is not None:
                out.set_exception(f.exception())
                return
        if first.done() and second.done():
            out.set_result(None)

    first.add_done_callback(done)
    second.add_done_callback(done)
    return out


def _deliver(batch: list[tuple[asyncio.Queue[Event | Finished], Event | Finished]]) -> None:
    for stream, event in batch:
        stream.put_nowait(event)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting handler was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _drop_unsampled_kv(engine: Engine, session_id: SessionId) -> None:
    """After a failed step: a decoding session whose last token got its KV but no successor would
    have nothing left to feed, and its next request would wait forever; recompute that token."""
    session = engine.sessions.get(session_id)
    if session is not None:
        try:
            engine.rewind(session_id, len(session.tokens))  # keeps the tokens, cuts KV to len - 1
        except Exception:
            log.exception("engine_rewind_failed", session_id=session_id)


def cancel_all(engine: Engine, rids: list[RequestId]) -> None:
    for rid in rids:
        engine.cancel(rid)
