"""The daemon end to end: `h3d serve` as a subprocess, driven through its gRPC API.

- Streams: the text and token ids a Generate streams (over the Unix socket and over TCP) are the
  in-process engine's greedy output; 16 concurrent streams each get their own text's output.
- Backpressure and cancellation: with `max_pending_requests` 1 a second stream is refused
  (RESOURCE_EXHAUSTED with a `retry-after-ms` trailer) until the first is cancelled.
- Lifecycle: SIGTERM ends live streams with finish reason CANCELLED and exits 0; SIGHUP reloads
  the configuration file; bad configurations exit non-zero naming the key.
- Errors: a table of bad inputs and their status codes, and a property test that throws random
  field values at every RPC (never INTERNAL, no session leaked).
- Auth, health, reflection, Prometheus metrics and the structured log events.

Each daemon runs with one torch thread (OMP_NUM_THREADS=1): tiny models gain nothing from more,
and spinning threads on a busy machine slow every step tenfold.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_daemon import RunningDaemon, running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d._proto.h3.v1 import h3_pb2_grpc as rpc
from h3d.config import EngineConfig
from h3d.daemon.status import status_of
from h3d.daemon.worker import EngineWorker, Finished
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import AppendDone, FinishReason, PrefillProgress, RequestFailed, TokenDelta
from h3d.errors import InvalidRequest, LogNotDurable
from h3d.store.files import FileOps

MODEL = "llama_gqa4_tied"
VOCAB = 512
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
T = 120.0  # deadline of every RPC: generous, the machine may be busy
Code = grpc.StatusCode

TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the cache in blocks",
    "Café, naïve, 你好，世界。 Emoji: 🙂 🚀",
)


# ---- helpers ---------------------------------------------------------------------------------


def greedy(n: int, **kw: Any) -> pb.SamplingParams:
    return pb.SamplingParams(**{"max_tokens": n, "temperature": 0.0, "ignore_eos": True, **kw})


def new_session(h3: rpc.H3Stub, text: str = "", metadata: Any = None, **kw: Any) -> str:
    sid: str = h3.CreateSession(pb.CreateSessionRequest(**kw), timeout=T, metadata=metadata).session_id
    if text:
        msgs = list(h3.AppendContext(pb.AppendContextRequest(session_id=sid, text=text), timeout=T, metadata=metadata))
        assert msgs[-1].HasField("done"), msgs
    return sid


@dataclass
class Stream:
    ids: list[int]
    text: str
    done: pb.GenerateSummary


def collect(msgs: list[pb.GenerateResponse]) -> Stream:
    """Deltas then exactly one summary, last."""
    assert msgs, "the stream ended without a message"
    assert msgs[-1].HasField("done"), msgs[-1]
    assert all(m.HasField("delta") for m in msgs[:-1])
    return Stream(
        ids=[t for m in msgs[:-1] for t in m.delta.token_ids],
        text="".join(m.delta.text for m in msgs[:-1]),
        done=msgs[-1].done,
    )


def generate(h3: rpc.H3Stub, sid: str, n: int, prompt: str = "", **kw: Any) -> Stream:
    req = pb.GenerateRequest(session_id=sid, prompt=prompt, **{"sampling": greedy(n), **kw})
    return collect(list(h3.Generate(req, timeout=T)))


def code_of(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return Code.OK, ""


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def health(d: RunningDaemon, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(d.channel())
    status: int = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=T).status
    return status


def list_all(h3: rpc.H3Stub, page_size: int = 7, metadata: Any = None) -> list[pb.Session]:
    """Every session the caller sees, page by page."""
    out: list[pb.Session] = []
    token = ""
    while True:
        page = h3.ListSessions(
            pb.ListSessionsRequest(page_size=page_size, page_token=token), timeout=T, metadata=metadata
        )
        out += page.sessions
        assert len(out) <= page.total
        token = page.next_page_token
        if not token:
            assert len(out) == page.total
            return out


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def serve_cmd(model: Path, data_dir: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "h3d.cli", "serve", "--model", str(model), "--data-dir", str(data_dir), *flags]


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint(MODEL)


@pytest.fixture(scope="module")
def reference(model: Path) -> Iterator[Callable[[str, int], tuple[list[int], str]]]:
    """reference(text, n) -> the in-process engine's greedy (token ids, text) after appending `text`."""
    engine = Engine(EngineConfig.build(model=str(model)))
    cache: dict[tuple[str, int], tuple[list[int], str]] = {}

    def get(text: str, n: int) -> tuple[list[int], str]:
        if (text, n) not in cache:
            sid = engine.create_session()
            engine.append(sid, text=text)
            done = engine.complete(sid, "", SamplingParams(max_tokens=n, ignore_eos=True))
            engine.close_session(sid)
            assert len(done.token_ids) == n
            cache[(text, n)] = (list(done.token_ids), done.text)
        return cache[(text, n)]

    yield get
    engine.close()


@pytest.fixture(scope="module")
def main_daemon(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """Default limits, TCP on 127.0.0.1 and the Prometheus endpoint."""
    data = tmp_path_factory.mktemp("main-daemon")
    with running_daemon(model, data, extra=["--metrics-listen", "127.0.0.1:0"], tcp=True, env=ENV) as d:
        yield d


LIMITS = ["--max-context-tokens", "64", "--max-tokens-limit", "100", "--max-message-bytes", "65536"]


@pytest.fixture(scope="module")
def limits_daemon(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """Small limits: 64 context tokens, 100 tokens per request, 64 KiB messages."""
    data = tmp_path_factory.mktemp("limits-daemon")
    with running_daemon(model, data, extra=LIMITS, tcp=False, env=ENV) as d:
        yield d


# ---- 1, 2: streams equal the engine's greedy output --------------------------------------------


@pytest.mark.parametrize("tcp", [False, True], ids=["unix", "tcp"])
def test_stream_equals_engine_greedy(
    tcp: bool, main_daemon: RunningDaemon, reference: Callable[[str, int], tuple[list[int], str]]
) -> None:
    h3 = main_daemon.h3(tcp=tcp)
    for text in TEXTS:
        want_ids, want_text = reference(text, 16)
        sid = new_session(h3, text)
        n_context = h3.GetSession(pb.GetSessionRequest(session_id=sid), timeout=T).num_tokens
        got = generate(h3, sid, 16)
        assert got.ids == want_ids, text
        assert got.text == want_text, text
        assert got.done.finish_reason == pb.FINISH_REASON_LENGTH
        assert got.done.completion_tokens == 16
        assert got.done.prompt_tokens == n_context
        after = h3.GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True), timeout=T)
        assert after.num_tokens == n_context + 16 and list(after.token_ids)[-16:] == want_ids
        assert not after.busy

        # Generate(prompt=T) on a fresh session == AppendContext(T) then Generate.
        direct = generate(h3, new_session(h3), 16, prompt=text)
        assert direct.ids == want_ids and direct.text == want_text
        assert direct.done.prompt_tokens == n_context


def test_tiny_temperature_samples_as_greedy(
    main_daemon: RunningDaemon, reference: Callable[[str, int], tuple[list[int], str]]
) -> None:
    """temperature 1e-45 is valid (>= 0): logits / 1e-45 overflow, so the daemon samples greedily
    instead of failing the engine step, and a greedy stream batched with it is unharmed."""
    h3 = main_daemon.h3()
    with ThreadPoolExecutor(2) as pool:
        tiny, plain = pool.map(
            lambda kw: generate(h3, new_session(h3, TEXTS[0]), 16, **kw),
            [{"sampling": greedy(16, temperature=1e-45, seed=7)}, {}],
        )
    want_ids, want_text = reference(TEXTS[0], 16)
    for stream in (tiny, plain):
        assert stream.ids == want_ids and stream.text == want_text
        assert stream.done.finish_reason == pb.FINISH_REASON_LENGTH
    assert not main_daemon.events("engine_step_failed")


def test_sixteen_concurrent_streams(
    main_daemon: RunningDaemon, reference: Callable[[str, int], tuple[list[int], str]]
) -> None:
    texts = [f"Story {i}: {TEXTS[i % 3]} {'and again ' * (i % 4)}number {i * 7}" for i in range(16)]
    want = [reference(t, 12) for t in texts]
    h3 = main_daemon.h3()
    barrier = threading.Barrier(16, timeout=T)

    def run(text: str) -> Stream:
        sid = new_session(h3, text)
        barrier.wait()  # all 16 generate at once, batched by the engine
        return generate(h3, sid, 12)

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(run, texts))
    for text, (ids, out), stream in zip(texts, want, got, strict=True):
        assert stream.ids == ids, text
        assert stream.text == out, text
        assert stream.done.finish_reason == pb.FINISH_REASON_LENGTH and stream.done.completion_tokens == 12


# ---- 3: a cancelled stream frees its slot ------------------------------------------------------


def test_cancelled_stream_frees_its_slot(model: Path, tmp_path: Path) -> None:
    # A stream far too long to finish on its own before the client cancels it, even on a slow host.
    extra = ["--max-pending-requests", "1", "--max-context-tokens", "16384", "--retry-after-ms", "250",
             "--max-tokens-limit", "16000"]  # fmt: skip
    with running_daemon(model, tmp_path / "d", extra=extra, tcp=False, env=ENV) as d:
        h3 = d.h3()
        first, second = new_session(h3, TEXTS[0]), new_session(h3, TEXTS[1])
        n_context = h3.GetSession(pb.GetSessionRequest(session_id=first), timeout=T).num_tokens
        call = h3.Generate(pb.GenerateRequest(session_id=first, sampling=greedy(16000)), timeout=T)
        head = [next(call) for _ in range(3)]
        assert all(m.HasField("delta") for m in head)

        # The one slot is taken: another stream is refused, with a retry hint.
        with pytest.raises(grpc.RpcError) as refused:
            list(h3.Generate(pb.GenerateRequest(session_id=second, sampling=greedy(4)), timeout=T))
        assert refused.value.code() == Code.RESOURCE_EXHAUSTED
        trailers = dict(refused.value.trailing_metadata() or ())
        assert trailers.get("retry-after-ms") == "250", trailers
        code, _ = code_of(lambda: list(h3.AppendContext(pb.AppendContextRequest(session_id=second, text="x"))))
        assert code == Code.RESOURCE_EXHAUSTED
        # Unary calls take no slot.
        assert h3.GetSession(pb.GetSessionRequest(session_id=first), timeout=T).busy

        call.cancel()
        with pytest.raises(grpc.RpcError) as cancelled:
            list(call)
        assert cancelled.value.code() == Code.CANCELLED

        # The slot comes back once the handler has ended (poll: that happens after cancel()).
        def admitted() -> Stream | None:
            try:
                return generate(h3, second, 4)
            except grpc.RpcError as exc:
                assert exc.code() == Code.RESOURCE_EXHAUSTED, exc
                return None

        stream = wait_for(admitted, what="the slot to be freed")
        assert stream.done.finish_reason == pb.FINISH_REASON_LENGTH and stream.done.completion_tokens == 4

        # The cancelled session is idle again, keeps what it generated, and serves a new request.
        def idle() -> pb.Session | None:
            s = h3.GetSession(pb.GetSessionRequest(session_id=first), timeout=T)
            return None if s.busy else s

        s = wait_for(idle, what="the cancelled session to be idle")
        assert s.num_tokens >= n_context + len(head)
        assert generate(h3, first, 2).done.completion_tokens == 2
        rpc_events = wait_for(
            lambda: [e for e in d.events("rpc") if e.get("session_id") == first and e.get("code") == "CANCELLED"],
            what="the cancelled Generate's rpc event",
        )
        assert rpc_events[0]["method"] == "Generate"


# ---- 4: SIGTERM drains live streams -------------------------------------------------------------


def test_sigterm_ends_live_streams_with_cancelled(model: Path, tmp_path: Path) -> None:
    extra = ["--drain-timeout-s", "2", "--max-tokens-limit", "16000", "--max-context-tokens", "16384"]
    with running_daemon(model, tmp_path / "d", extra=extra, tcp=False, env=ENV) as d:
        h3 = d.h3()
        sids = [new_session(h3, f"{TEXTS[i % 3]} ({i})") for i in range(4)]
        started = [threading.Event() for _ in sids]
        results: list[Any] = [None] * len(sids)

        def run(i: int) -> None:
            msgs = []
            try:
                for m in h3.Generate(pb.GenerateRequest(session_id=sids[i], sampling=greedy(16000)), timeout=T):
                    msgs.append(m)
                    started[i].set()
                results[i] = msgs
            except grpc.RpcError as exc:
                results[i] = exc
            finally:
                started[i].set()

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(sids))]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(T)
        assert all(r is None for r in results), "a stream ended before SIGTERM"
        d.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(T)
            assert not t.is_alive()
        assert d.proc.wait(60) == 0
        for i, r in enumerate(results):
            assert isinstance(r, list), f"stream {i} failed: {r!r}"
            stream = collect(r)
            assert stream.done.finish_reason == pb.FINISH_REASON_CANCELLED
            assert 0 < stream.done.completion_tokens == len(stream.ids) < 5000
        wait_for(lambda: d.events("stopped"), 10, "the stopped event")
        (draining,) = d.events("draining")
        assert draining["in_flight"] == 4
        (stopped,) = d.events("stopped")
        assert stopped["requests_cancelled"] == 4 and stopped["requests_finished"] == 0
        assert not d.socket.exists()


# ---- 6: random field values at every RPC --------------------------------------------------------

OK_OR_REFUSED = {Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED}
U32 = st.one_of(st.sampled_from([0, 1, VOCAB - 1, VOCAB, 2**31, 2**32 - 1]), st.integers(0, 2**32 - 1))
WILD_FLOATS = st.one_of(
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 1e-45, 1e-38, 1.0, 1.5, 3e38]),
    st.floats(width=32),
)
TEXT = st.text(max_size=20)
POLICY = st.sampled_from(["", "exact", "fixed", "layerwise", "attention_entropy"])
WILD_POLICY = st.one_of(st.sampled_from(["EXACT", " exact", "lru"]), TEXT)
RPCS = (
    "CreateSession", "GetSession", "ListSessions", "CloseSession", "AppendContext", "Generate", "GetStats",
    "EvictSession", "PinSession", "SnapshotSession", "SetPolicy", "Drain", "GetConfig",
)  # fmt: skip


def sometimes_wild(data: st.DataObject) -> bool:
    """One draw in four takes any value of a field's type, in range or not."""
    return data.draw(st.integers(0, 3)) == 3


def sampling_params(data: st.DataObject) -> pb.SamplingParams:
    """Mostly valid and cheap (at most 4 tokens, any temperature >= 0), sometimes anything."""
    msg = pb.SamplingParams(ignore_eos=data.draw(st.booleans()))
    wild = sometimes_wild(data)
    max_tokens = data.draw(
        st.one_of(st.none(), st.sampled_from([0, 101, 2**32 - 1]), U32) if wild else st.none() | st.integers(1, 4)
    )
    if max_tokens is not None:
        msg.max_tokens = max_tokens
    # Valid temperatures include tiny ones: softmax(logits / 1e-45) must not blow up.
    temperature = st.sampled_from([1e-45, 1e-38, 0.7, 0.0, 1e-30, 7.0]) | st.floats(0, 10, width=32)
    top_p = st.sampled_from([0.9, 1e-45, 0.5, 1.0]) | st.floats(0, 1, exclude_min=True, width=32)
    fields = {"temperature": temperature, "top_p": top_p, "top_k": st.integers(0, 600)}
    for name, strategy in fields.items():
        value = data.draw((U32 if name == "top_k" else WILD_FLOATS) | st.none() if wild else strategy | st.none())
        if value is not None:
            setattr(msg, name, value)
    seed = data.draw(st.none() | st.integers(0, 2**64 - 1))
    if seed is not None:
        msg.seed = seed
    if wild:
        msg.stop.extend(data.draw(st.lists(st.text(max_size=4), max_size=3) | st.just(["z"] * 17)))
    else:
        msg.stop.extend(data.draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)))
    msg.stop_token_ids.extend(data.draw(st.lists(U32 if wild else st.integers(0, VOCAB - 1), max_size=3)))
    return msg


def token_ids(data: st.DataObject, wild: bool, max_size: int) -> list[int]:
    """Token ids: valid and at least one, or (wild) any uint32s, perhaps none."""
    if wild:
        return data.draw(st.lists(U32, max_size=max_size))
    return data.draw(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=max_size))


@dataclass
class FuzzState:
    live: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    created: int = 0
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)


def test_random_field_values_never_fail_internally(limits_daemon: RunningDaemon) -> None:
    d = limits_daemon
    h3, admin = d.h3(), d.admin()
    before = {s.session_id for s in list_all(h3)}
    state = FuzzState()

    def session_id(data: st.DataObject, current: str | None) -> str:
        """Mostly the example's own session; else another live one, a closed one, or garbage. (The
        same draws whatever the state, so that hypothesis can replay an example.)"""
        kind, index = data.draw(st.integers(0, 9)), data.draw(st.integers(0, 10**6))
        garbage = data.draw(st.one_of(TEXT, st.text(alphabet="0123456789abcdef", min_size=32, max_size=32)))
        if kind < 6 and current is not None:
            return current
        if kind < 7 and state.live:
            return state.live[index % len(state.live)]
        if kind < 8 and state.closed:
            return state.closed[index % len(state.closed)]
        return garbage

    def op(name: str, data: st.DataObject, sid: str | None) -> tuple[Message, Callable[[], Any]]:
        req: Message
        if name == "CreateSession":
            prompt = data.draw(TEXT if sometimes_wild(data) else st.text(min_size=1, max_size=10))
            policy = data.draw(WILD_POLICY if sometimes_wild(data) else POLICY)
            req = pb.CreateSessionRequest(system_prompt=prompt, policy=policy)
            if data.draw(st.booleans()):
                req.sampling.CopyFrom(sampling_params(data))
            return req, lambda: h3.CreateSession(req, timeout=T)
        if name == "GetSession":
            req = pb.GetSessionRequest(session_id=session_id(data, sid), with_tokens=data.draw(st.booleans()))
            return req, lambda: h3.GetSession(req, timeout=T)
        if name == "ListSessions":
            token = data.draw(st.one_of(st.just(""), st.integers(-5, 10**20).map(str), TEXT))
            req = pb.ListSessionsRequest(
                page_size=data.draw(st.integers(0, 1000) | st.sampled_from([1001]) | U32), page_token=token
            )
            return req, lambda: h3.ListSessions(req, timeout=T)
        if name == "CloseSession":
            req = pb.CloseSessionRequest(session_id=session_id(data, sid), purge=data.draw(st.booleans()))
            return req, lambda: h3.CloseSession(req, timeout=T)
        if name == "AppendContext":
            wild = sometimes_wild(data)
            what = data.draw(st.sampled_from(["text", "ids", "both", "neither"] if wild else ["text", "ids"]))
            text, ids = data.draw(TEXT if wild else st.text(min_size=1, max_size=10)), token_ids(data, wild, 12)
            req = pb.AppendContextRequest(session_id=session_id(data, sid))
            req.text = text if what in ("text", "both") else ""
            req.token_ids.extend(ids if what in ("ids", "both") else [])
            return req, lambda: list(h3.AppendContext(req, timeout=T))
        if name == "Generate":
            wild = sometimes_wild(data)
            what = data.draw(st.sampled_from(["none", "prompt", "ids", "both"] if wild else ["none", "prompt", "ids"]))
            text, ids = data.draw(TEXT if wild else st.text(min_size=1, max_size=8)), token_ids(data, wild, 6)
            req = pb.GenerateRequest(session_id=session_id(data, sid), sampling=sampling_params(data))
            req.prompt = text if what in ("prompt", "both") else ""
            req.prompt_token_ids.extend(ids if what in ("ids", "both") else [])
            return req, lambda: list(h3.Generate(req, timeout=T))
        if name == "GetStats":
            req = pb.GetStatsRequest(session_id=data.draw(st.just("") | st.just(session_id(data, sid))))
            return req, lambda: h3.GetStats(req, timeout=T)
        if name == "EvictSession":
            req = pb.EvictSessionRequest(session_id=session_id(data, sid), to=data.draw(st.integers(0, 3)))
            return req, lambda: admin.EvictSession(req, timeout=T)
        if name == "PinSession":
            ttl = data.draw(WILD_FLOATS.map(float) | st.floats())
            req = pb.PinSessionRequest(session_id=session_id(data, sid), ttl_s=ttl, unpin=data.draw(st.booleans()))
            return req, lambda: admin.PinSession(req, timeout=T)
        if name == "SnapshotSession":
            req = pb.SnapshotSessionRequest(session_id=session_id(data, sid))
            return req, lambda: admin.SnapshotSession(req, timeout=T)
        if name == "SetPolicy":
            policy = data.draw(WILD_POLICY if sometimes_wild(data) else POLICY)
            req = pb.SetPolicyRequest(session_id=session_id(data, sid), policy=policy)
            return req, lambda: admin.SetPolicy(req, timeout=T)
        if name == "Drain":  # only values that must be refused: a valid one would drain the daemon
            req = pb.DrainRequest(timeout_s=data.draw(st.sampled_from([-1.0, -1e-9, math.nan, math.inf, -math.inf])))
            return req, lambda: admin.Drain(req, timeout=T)
        assert name == "GetConfig"
        req = pb.GetConfigRequest()
        return req, lambda: admin.GetConfig(req, timeout=T)

    def check(name: str, data: st.DataObject, sid: str | None) -> Any:
        """One call: OK or an expected refusal; the bookkeeping of sessions created and closed."""
        req, call = op(name, data, sid)
        try:
            result, code, details = call(), Code.OK, ""
        except grpc.RpcError as exc:
            result, code, details = None, exc.code(), exc.details()
        state.codes[(name, code.name)] += 1
        assert code in OK_OR_REFUSED, f"{name}({req}) -> {code.name}: {details}"
        assert code == Code.OK or details, f"{name}: {code.name} without a message"
        if code != Code.OK:
            return None
        if name == "CreateSession":
            state.live.append(result.session_id)
            state.created += 1
        elif name == "CloseSession" and req.purge:  # without purge it stays, closed
            state.live.remove(req.session_id)
            state.closed.append(req.session_id)
        elif name == "Generate":
            stream = collect(result)
            assert stream.done.completion_tokens == len(stream.ids) <= (req.sampling.max_tokens or 100)
            assert stream.done.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        elif name == "AppendContext":
            assert result[-1].HasField("done") and all(m.HasField("progress") for m in result[:-1])
        return result

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        created = check("CreateSession", data, None)
        sid = created.session_id if created is not None else None
        check("AppendContext", data, sid)
        for _ in range(data.draw(st.integers(1, 5))):
            check(data.draw(st.sampled_from(RPCS)), data, sid)
        check("Generate", data, sid)
        if data.draw(st.booleans()) and sid in state.live:
            check("CloseSession", data, sid)

    run()

    # And each RPC on its own, whatever the draws above favoured.
    def alone(name: str) -> Any:
        @settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(data=st.data())
        def each(data: st.DataObject) -> None:
            created = check("CreateSession", data, None)
            check(name, data, created.session_id if created is not None else None)

        return each

    for name in RPCS:
        alone(name)()
    assert d.proc.poll() is None
    assert health(d) == health_pb2.HealthCheckResponse.SERVING
    assert not d.events("rpc_internal_error") and not d.events("engine_step_failed")
    ok = {name: n for (name, code), n in state.codes.items() if code == "OK"}
    seen = "; ".join(f"{name} {code}: {n}" for (name, code), n in sorted(state.codes.items()))
    assert ok.get("CreateSession", 0) >= 20 and ok.get("Generate", 0) >= 10 and ok.get("AppendContext", 0) >= 10, seen
    assert {name for name, _ in state.codes} == set(RPCS), seen  # every RPC was called
    # No session leaked, none lost.
    now = {s.session_id for s in list_all(h3)}
    assert now - before == set(state.live)
    assert not now & set(state.closed)
    assert len(now) == len(before) + state.created - len(state.closed)
    for sid in state.closed:
        code, _ = code_of(lambda sid=sid: h3.GetSession(pb.GetSessionRequest(session_id=sid), timeout=T))
        assert code == Code.NOT_FOUND
    # And the daemon still generates.
    assert generate(h3, new_session(h3, "still here"), 3).done.completion_tokens == 3


def test_worker_failed_step_leaves_sessions_usable(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error in an engine step fails the requests in flight (INTERNAL), and their
    sessions serve the next request: a decoding session whose last token got its KV in the failed
    step must not wait forever for work (the worker spun on it, the client hung)."""
    import h3d.engine.engine as engine_module

    real = engine_module.sample_batch
    calls = itertools.count(1)

    def flaky(*args: Any) -> list[int]:
        if next(calls) == 3:  # the third sampling step: after prefill and one decode step
            raise RuntimeError("injected fault")
        return real(*args)

    monkeypatch.setattr(engine_module, "sample_batch", flaky)
    engine = Engine(EngineConfig.build(model=str(model)))
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def main() -> tuple[Any, Any, list[int]]:
        worker = EngineWorker(engine, asyncio.get_running_loop())
        worker.start()
        try:
            sid = await worker.call(lambda e: e.create_session())
            await worker.call(lambda e: e.append(sid, text=TEXTS[0]))

            async def run() -> Any:
                _, events = await worker.start_request(lambda e: e.submit(sid, generate=True, params=params))
                while not isinstance(event := await asyncio.wait_for(events.get(), T), Finished | RequestFailed):
                    pass
                return event

            failed = await run()
            context = await worker.call(lambda e: list(e.session(sid).tokens))
            return failed, await run(), context
        finally:
            worker.stop(30)

    failed, done, context = asyncio.run(main())
    assert isinstance(failed, RequestFailed) and "internal error" in str(failed.error)
    assert isinstance(done, Finished) and len(done.done.token_ids) == 6
    assert done.summary.completion_tokens == 6  # the summary made on the engine thread, with the end
    # What it generated continues the context as a fresh session fed the same tokens would.
    fresh = engine.create_session()
    engine.append(fresh, token_ids=context)
    assert list(done.done.token_ids) == list(engine.complete(fresh, "", params).token_ids)
    engine.close()


class _HeldFsyncs(FileOps):
    """fsyncs off the main thread wait until `release` is set, then fail if `fail`."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.fail = False
        self.held = 0

    def fsync(self, fd: int) -> None:
        if threading.current_thread().name.startswith("h3d-log-sync"):
            self.held += 1
            assert self.release.wait(30)
            if self.fail:
                raise OSError(5, "fsync failed (a test's disk)")
        super().fsync(fd)


@pytest.mark.parametrize("fail", [False, True], ids=["durable", "fsync-fails"])
def test_a_generation_s_end_waits_for_its_log_s_fsync_off_the_engine_thread(
    model: Path, tmp_path: Path, fail: bool
) -> None:
    """In the daemon a Generate's end waits for its token log's fsync on the store's thread, not
    in the step that ends it (every stream of that step would wait for the disk): its tokens all
    arrive while the fsync is held, the engine goes on stepping, and the end comes once the fsync
    returned, the log then synced. A failed fsync ends the stream with UNAVAILABLE's error
    (`LogNotDurable`) after every token it streamed."""
    engine = Engine(EngineConfig.build(model=str(model), session_log_path=str(tmp_path / "logs")))
    assert engine.journal is not None
    files = _HeldFsyncs()
    files.fail = fail
    engine.journal.files = files
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main() -> tuple[list[Any], list[Any], int, int]:
        worker = EngineWorker(engine, asyncio.get_running_loop())
        worker.start()
        try:
            sid = await worker.call(lambda e: e.create_session())
            await worker.call(lambda e: e.append(sid, text=TEXTS[0]))
            _, events = await worker.start_request(lambda e: e.submit(sid, generate=True, params=params))
            first: list[Any] = []
            while len([x for x in first if isinstance(x, TokenDelta)]) < 4:
                first.append(await asyncio.wait_for(events.get(), T))
            await asyncio.sleep(0.3)
            assert events.empty() and files.held >= 1  # the end waits for the fsync held on the store's thread
            steps = await worker.call(lambda e: e.counters.steps)  # the engine thread answers meanwhile
            await worker.call(lambda e: e.complete(e.create_session(), "x", SamplingParams(max_tokens=2)))
            later = await worker.call(lambda e: e.counters.steps)
            files.release.set()
            end = [await asyncio.wait_for(events.get(), T)]
            return first, end, steps, later
        finally:
            worker.stop(30)

    first, end, steps, later = asyncio.run(main())
    assert all(isinstance(x, TokenDelta) for x in first)
    assert later > steps  # steps ran while the first generation's fsync was held
    sid = first[0].session_id
    if fail:
        assert isinstance(end[0], RequestFailed) and isinstance(end[0].error, LogNotDurable)
        assert status_of(end[0].error) == grpc.StatusCode.UNAVAILABLE and "fsync" in str(end[0].error)
    else:
        assert isinstance(end[0], Finished) and end[0].summary.completion_tokens == 4
        assert not engine.journal.unsynced(sid)
    engine.close()


def test_a_prompt_s_generation_is_chained_to_its_append(model: Path) -> None:
    """Generate with a prompt is an append with its generation chained (`start_request`'s `then`):
    submitted on the engine thread at the step that ends the append, so the next step already
    runs it while another session keeps the engine busy (no step boundary lost to a round trip
    through the event loop), with the tokens of `Engine.complete`. A chain whose second request
    is refused ends with a RequestFailed after the AppendDone; cancelling by the first id
    cancels the generation."""
    engine = Engine(EngineConfig.build(model=str(model)))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    steps: list[tuple[set[Any], list[Any]]] = []  # per step: the requests live at its start, its events
    real = engine.step

    def step() -> list[Any]:
        live = set(engine.requests())
        events = real()
        steps.append((live, events))
        return events

    engine.step = step  # type: ignore[method-assign]

    def refuse(e: Engine) -> Any:
        raise InvalidRequest("refused after the append")

    async def until(events: asyncio.Queue[Any], kinds: Any) -> list[Any]:
        """The stream's events up to one of `kinds`, without its prefill progress."""
        got: list[Any] = []
        while not got or not isinstance(got[-1], kinds):
            event = await asyncio.wait_for(events.get(), T)
            if not isinstance(event, PrefillProgress):
                got.append(event)
        return got

    async def until_end(events: asyncio.Queue[Any]) -> list[Any]:
        return await until(events, Finished | RequestFailed)

    async def main() -> tuple[Any, ...]:
        worker = EngineWorker(engine, asyncio.get_running_loop())
        worker.start()
        try:
            busy = await worker.call(lambda e: e.create_session())
            await worker.call(lambda e: e.append(busy, text=TEXTS[1]))
            long = SamplingParams(max_tokens=60, ignore_eos=True)
            _, other = await worker.start_request(lambda e: e.submit(busy, generate=True, params=long))
            sid = await worker.call(lambda e: e.create_session())
            rid, events = await worker.start_request(
                lambda e: e.submit(sid, text=TEXTS[0], generate=False),
                then=lambda e: e.submit(sid, generate=True, params=params),
            )
            chained = await until_end(events)
            _, events = await worker.start_request(lambda e: e.submit(sid, text=" more", generate=False), then=refuse)
            refused = await until_end(events)
            rid2, events = await worker.start_request(
                lambda e: e.submit(sid, text=" again", generate=False),
                then=lambda e: e.submit(sid, generate=True, params=long),
            )
            assert [type(e) for e in await until(events, AppendDone)] == [AppendDone]
            worker.cancel(rid2)  # the append's id: the generation is what is live
            cancelled = await until_end(events)
            await until_end(other)
            return rid, chained, refused, cancelled
        finally:
            worker.stop(30)

    rid, chained, refused, cancelled = asyncio.run(main())
    assert isinstance(chained[0], AppendDone) and chained[0].request_id == rid
    assert all(isinstance(e, TokenDelta) for e in chained[1:-1]) and len(chained) == 6
    end = chained[-1]
    assert isinstance(end, Finished) and end.done.request_id != rid
    ended = next(i for i, (_, events) in enumerate(steps) if any(e.request_id == rid for e in events))
    assert end.done.request_id in steps[ended + 1][0]  # in flight from the very next step
    assert any(live - {end.done.request_id} for live, _ in steps[ended : ended + 2])  # the busy session ran too
    fresh = engine.create_session()
    assert end.done.token_ids == engine.complete(fresh, TEXTS[0], params).token_ids
    assert [type(e) for e in refused] == [AppendDone, RequestFailed]
    assert str(refused[1].error) == "refused after the append"
    assert isinstance(cancelled[-1], Finished) and cancelled[-1].done.finish_reason == FinishReason.CANCELLED
    assert len(cancelled[-1].done.token_ids) < 60
    engine.close()


# ---- 5: every bad input, one status code each ---------------------------------------------------


@dataclass
class Ctx:
    d: RunningDaemon
    h3: rpc.H3Stub
    admin: rpc.H3AdminStub

    def session(self, text: str = "hello there") -> str:
        return new_session(self.h3, text)

    def append(self, **kw: Any) -> Any:
        return list(self.h3.AppendContext(pb.AppendContextRequest(**kw), timeout=T))

    def generate(self, **kw: Any) -> Any:
        return list(self.h3.Generate(pb.GenerateRequest(**kw), timeout=T))

    def raw_append(self, payload: bytes) -> Any:
        call = self.d.channel().unary_stream(
            "/h3.v1.H3/AppendContext",
            request_serializer=lambda b: b,
            response_deserializer=pb.AppendContextResponse.FromString,
        )
        return list(call(payload, timeout=T))

    def raw_create(self, payload: bytes) -> Any:
        call = self.d.channel().unary_unary(
            "/h3.v1.H3/CreateSession", request_serializer=lambda b: b, response_deserializer=pb.Session.FromString
        )
        return call(payload, timeout=T)


def bad(what: str, code: grpc.StatusCode, words: str, call: Callable[[Ctx], Any]) -> Any:
    """A row: `call` must end with `code`, its message containing `words`."""
    return pytest.param(what, call, code, words, id=what)


NO_SUCH = "0123456789abcdef0123456789abcdef"
BAD_UTF8 = b"\xff\xfe"

BAD_INPUTS = [
    bad(
        "GetSession unknown id",
        Code.NOT_FOUND,
        "no session",
        lambda c: c.h3.GetSession(pb.GetSessionRequest(session_id=NO_SUCH)),
    ),
    bad(
        "Generate unknown id",
        Code.NOT_FOUND,
        "no session",
        lambda c: c.generate(session_id=NO_SUCH, sampling=greedy(2)),
    ),
    bad("AppendContext unknown id", Code.NOT_FOUND, "no session", lambda c: c.append(session_id=NO_SUCH, text="x")),
    bad(
        "CloseSession unknown id",
        Code.NOT_FOUND,
        "no session",
        lambda c: c.h3.CloseSession(pb.CloseSessionRequest(session_id=NO_SUCH)),
    ),
    bad(
        "GetStats unknown id",
        Code.NOT_FOUND,
        "no session",
        lambda c: c.h3.GetStats(pb.GetStatsRequest(session_id=NO_SUCH)),
    ),
    bad(
        "EvictSession unknown id",
        Code.NOT_FOUND,
        "no session",
        lambda c: c.admin.EvictSession(pb.EvictSessionRequest(session_id=NO_SUCH, to=pb.TIER_DDR)),
    ),
    bad(
        "CloseSession purge twice",
        Code.NOT_FOUND,
        "no session",
        lambda c: [c.h3.CloseSession(pb.CloseSessionRequest(session_id=s, purge=True)) for s in [c.session()] * 2],
    ),
    bad(
        "append beyond max_context_tokens",
        Code.INVALID_ARGUMENT,
        "max_context_tokens",
        lambda c: c.append(session_id=c.session(), token_ids=[5] * 100),
    ),
    bad(
        "system prompt beyond max_context_tokens",
        Code.INVALID_ARGUMENT,
        "max_context_tokens",
        lambda c: c.h3.CreateSession(pb.CreateSessionRequest(system_prompt="word " * 200)),
    ),
    bad(
        "generate on a full context",
        Code.INVALID_ARGUMENT,
        "max_context_tokens",
        lambda c: [
            (c.append(session_id=s, token_ids=[7] * 64), c.generate(session_id=s, sampling=greedy(1)))
            for s in [c.session("")]
        ],
    ),
    bad(
        "max_tokens 0",
        Code.INVALID_ARGUMENT,
        "max_tokens",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(0)),
    ),
    bad(
        "max_tokens above max_tokens_limit",
        Code.INVALID_ARGUMENT,
        "max_tokens",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(101)),
    ),
    bad(
        "max_tokens above the limit with a prompt",
        Code.INVALID_ARGUMENT,
        "max_tokens",
        lambda c: c.generate(session_id=c.session(), prompt="more", sampling=greedy(101)),
    ),
    bad(
        "max_tokens 0 as a session default",
        Code.INVALID_ARGUMENT,
        "max_tokens",
        lambda c: c.h3.CreateSession(pb.CreateSessionRequest(sampling=pb.SamplingParams(max_tokens=0))),
    ),
    bad(
        "temperature -1",
        Code.INVALID_ARGUMENT,
        "temperature",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, temperature=-1.0)),
    ),
    bad(
        "temperature nan",
        Code.INVALID_ARGUMENT,
        "temperature",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, temperature=math.nan)),
    ),
    bad(
        "temperature inf",
        Code.INVALID_ARGUMENT,
        "temperature",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, temperature=math.inf)),
    ),
    bad(
        "top_p 0",
        Code.INVALID_ARGUMENT,
        "top_p",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, top_p=0.0)),
    ),
    bad(
        "top_p 1.5",
        Code.INVALID_ARGUMENT,
        "top_p",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, top_p=1.5)),
    ),
    bad(
        "top_p nan",
        Code.INVALID_ARGUMENT,
        "top_p",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, top_p=math.nan)),
    ),
    bad(
        "empty stop string",
        Code.INVALID_ARGUMENT,
        "stop",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, stop=[""])),
    ),
    bad(
        "17 stop strings",
        Code.INVALID_ARGUMENT,
        "stop",
        lambda c: c.generate(session_id=c.session(), sampling=greedy(2, stop=["q"] * 17)),
    ),
    bad(
        "invalid UTF-8 in AppendContext.text",
        Code.INVALID_ARGUMENT,
        "malformed",
        lambda c: c.raw_append(
            pb.AppendContextRequest(session_id=c.session()).SerializeToString() + b"\x12\x02" + BAD_UTF8
        ),
    ),
    bad(
        "invalid UTF-8 in CreateSession.system_prompt",
        Code.INVALID_ARGUMENT,
        "malformed",
        lambda c: c.raw_create(b"\x0a\x02" + BAD_UTF8),
    ),
    bad(
        "generate from an empty context",
        Code.INVALID_ARGUMENT,
        "empty context",
        lambda c: c.generate(session_id=c.session(""), sampling=greedy(2)),
    ),
    bad(
        "token id = vocab in AppendContext",
        Code.INVALID_ARGUMENT,
        "vocabulary",
        lambda c: c.append(session_id=c.session(), token_ids=[1, VOCAB]),
    ),
    bad(
        "token id = 2**32-1 in Generate",
        Code.INVALID_ARGUMENT,
        "vocabulary",
        lambda c: c.generate(session_id=c.session(), prompt_token_ids=[2**32 - 1], sampling=greedy(2)),
    ),
    bad(
        "both text and token_ids",
        Code.INVALID_ARGUMENT,
        "not both",
        lambda c: c.append(session_id=c.session(), text="a", token_ids=[5]),
    ),
    bad(
        "both prompt and prompt_token_ids",
        Code.INVALID_ARGUMENT,
        "not both",
        lambda c: c.generate(session_id=c.session(), prompt="a", prompt_token_ids=[5], sampling=greedy(2)),
    ),
    bad(
        "neither text nor token_ids",
        Code.INVALID_ARGUMENT,
        "text or token_ids",
        lambda c: c.append(session_id=c.session()),
    ),
    bad(
        "message over max_message_bytes",
        Code.RESOURCE_EXHAUSTED,
        "",
        lambda c: c.append(session_id=c.session(), text="x" * 100_000),
    ),
    bad(
        "unknown policy in CreateSession",
        Code.INVALID_ARGUMENT,
        "policy",
        lambda c: c.h3.CreateSession(pb.CreateSessionRequest(policy="lru")),
    ),
    bad(
        "unknown policy in SetPolicy",
        Code.INVALID_ARGUMENT,
        "policy",
        lambda c: c.admin.SetPolicy(pb.SetPolicyRequest(session_id=c.session(), policy="lru")),
    ),
    bad(
        "EvictSession to TIER_UNSPECIFIED",
        Code.INVALID_ARGUMENT,
        "to:",
        lambda c: c.admin.EvictSession(pb.EvictSessionRequest(session_id=c.session())),
    ),
    bad(
        "EvictSession to TIER_HBM",
        Code.INVALID_ARGUMENT,
        "to:",
        lambda c: c.admin.EvictSession(pb.EvictSessionRequest(session_id=c.session(), to=pb.TIER_HBM)),
    ),
    bad(
        "PinSession ttl_s -1",
        Code.INVALID_ARGUMENT,
        "ttl_s",
        lambda c: c.admin.PinSession(pb.PinSessionRequest(session_id=c.session(), ttl_s=-1.0)),
    ),
    bad(
        "Drain timeout_s nan",
        Code.INVALID_ARGUMENT,
        "timeout_s",
        lambda c: c.admin.Drain(pb.DrainRequest(timeout_s=math.nan)),
    ),
    bad(
        "ListSessions page_size 5000",
        Code.INVALID_ARGUMENT,
        "page_size",
        lambda c: c.h3.ListSessions(pb.ListSessionsRequest(page_size=5000)),
    ),
    bad(
        "ListSessions page_token garbage",
        Code.INVALID_ARGUMENT,
        "page_token",
        lambda c: c.h3.ListSessions(pb.ListSessionsRequest(page_token="garbage")),
    ),
    bad(
        "ListSessions page_token -1",
        Code.INVALID_ARGUMENT,
        "page_token",
        lambda c: c.h3.ListSessions(pb.ListSessionsRequest(page_token="-1")),
    ),
    # Last: the daemon stays draining.
    bad(
        "draining",
        Code.UNAVAILABLE,
        "draining",
        lambda c: (c.admin.Drain(pb.DrainRequest(timeout_s=1)), c.h3.CreateSession(pb.CreateSessionRequest())),
    ),
]


def test_generation_stops_at_max_context_tokens(limits_daemon: RunningDaemon) -> None:
    h3 = limits_daemon.h3()
    sid = new_session(h3)
    list(h3.AppendContext(pb.AppendContextRequest(session_id=sid, token_ids=list(range(3, 53))), timeout=T))
    stream = generate(h3, sid, 100)
    assert stream.done.finish_reason == pb.FINISH_REASON_LENGTH
    assert stream.done.prompt_tokens == 50 and stream.done.completion_tokens == len(stream.ids) == 14
    assert h3.GetSession(pb.GetSessionRequest(session_id=sid), timeout=T).num_tokens == 64

    # The daemon's default sampling.max_tokens (256) is above max_tokens_limit (100): requests that
    # leave max_tokens unset get the limit, they are not refused for a value they never sent.
    plain = h3.CreateSession(pb.CreateSessionRequest(), timeout=T)
    tuned = h3.CreateSession(pb.CreateSessionRequest(sampling=pb.SamplingParams(temperature=0.0)), timeout=T)
    assert plain.sampling.max_tokens == tuned.sampling.max_tokens == 100
    for session in (plain, tuned):
        list(h3.AppendContext(pb.AppendContextRequest(session_id=session.session_id, token_ids=[9] * 10), timeout=T))
        req = pb.GenerateRequest(session_id=session.session_id, sampling=pb.SamplingParams(ignore_eos=True))
        stream = collect(list(h3.Generate(req, timeout=T)))
        assert stream.done.finish_reason == pb.FINISH_REASON_LENGTH and stream.done.completion_tokens == 54
    # Each session's inter-token latency as the daemon sent its tokens (GetStats' own fields).
    for session in (plain, tuned):
        (mine,) = h3.GetStats(pb.GetStatsRequest(session_id=session.session_id), timeout=T).sessions
        assert 0 < mine.itl_ms_p50 <= mine.itl_ms_p99 < 60_000
    (fresh,) = h3.GetStats(pb.GetStatsRequest(session_id=new_session(h3)), timeout=T).sessions
    assert fresh.itl_ms_p50 == fresh.itl_ms_p99 == 0.0  # no token yet


@pytest.mark.parametrize(("what", "call", "code", "words"), BAD_INPUTS)
def test_bad_input(
    what: str, call: Callable[[Ctx], Any], code: grpc.StatusCode, words: str, limits_daemon: RunningDaemon
) -> None:
    d = limits_daemon
    ctx = Ctx(d, d.h3(), d.admin())
    got, details = code_of(lambda: call(ctx))
    assert got == code, f"{what}: {got.name} ({details})"
    assert words in details, details
    # The daemon goes on serving.
    assert d.proc.poll() is None
    stats = ctx.h3.GetStats(pb.GetStatsRequest(), timeout=T)
    assert stats.draining == (what == "draining")
    want = health_pb2.HealthCheckResponse.NOT_SERVING if what == "draining" else health_pb2.HealthCheckResponse.SERVING
    assert health(d) == want
    if what != "draining":
        assert ctx.h3.GetSession(pb.GetSessionRequest(session_id=ctx.session()), timeout=T).num_tokens > 0
    assert not d.events("rpc_internal_error")


# ---- 7: auth, ownership, configuration errors ---------------------------------------------------


def test_tokens_and_ownership(model: Path, tmp_path: Path) -> None:
    clients, admins = tmp_path / "clients", tmp_path / "admins"
    clients.write_text("# clients\ntoken-alice\n\ntoken-bob\n")
    admins.write_text("token-root\n")
    extra = ["--auth-token-file", str(clients), "--admin-token-file", str(admins)]
    with running_daemon(model, tmp_path / "d", extra=extra, tcp=False, env=ENV) as d:
        h3, admin = d.h3(), d.admin()
        alice, bob, root = bearer("token-alice"), bearer("token-bob"), bearer("token-root")
        for metadata in (None, bearer("token-mallory"), [("authorization", "token-alice")]):
            code, _ = code_of(lambda m=metadata: h3.CreateSession(pb.CreateSessionRequest(), timeout=T, metadata=m))
            assert code == Code.UNAUTHENTICATED, metadata
            code, _ = code_of(lambda m=metadata: h3.ListSessions(pb.ListSessionsRequest(), timeout=T, metadata=m))
            assert code == Code.UNAUTHENTICATED, metadata

        sid = new_session(h3, "alice's secret", metadata=alice)
        assert h3.GetSession(pb.GetSessionRequest(session_id=sid), timeout=T, metadata=alice).session_id == sid
        for call in (
            lambda: h3.GetSession(pb.GetSessionRequest(session_id=sid), timeout=T, metadata=bob),
            lambda: h3.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=T, metadata=bob),
            lambda: h3.GetStats(pb.GetStatsRequest(session_id=sid), timeout=T, metadata=bob),
            lambda: list(h3.Generate(pb.GenerateRequest(session_id=sid, sampling=greedy(2)), timeout=T, metadata=bob)),
        ):
            assert code_of(call)[0] == Code.NOT_FOUND
        assert [s.session_id for s in list_all(h3, metadata=alice)] == [sid]
        assert list_all(h3, metadata=bob) == []
        assert not h3.GetStats(pb.GetStatsRequest(), timeout=T, metadata=bob).sessions

        # H3Admin: client tokens are denied, no token is unauthenticated, the admin token works.
        assert code_of(lambda: admin.GetConfig(pb.GetConfigRequest(), timeout=T, metadata=alice))[0] == (
            Code.PERMISSION_DENIED
        )
        assert code_of(lambda: admin.GetConfig(pb.GetConfigRequest(), timeout=T))[0] == Code.UNAUTHENTICATED
        config = admin.GetConfig(pb.GetConfigRequest(), timeout=T, metadata=root).json
        assert json.loads(config)["auth_token_file"] == str(clients)
        assert "token-alice" not in config and "token-root" not in config
        # Admins see every session.
        assert h3.GetSession(pb.GetSessionRequest(session_id=sid), timeout=T, metadata=root).session_id == sid
        pinned = admin.PinSession(pb.PinSessionRequest(session_id=sid), timeout=T, metadata=root)
        assert pinned.pinned and pinned.pinned_until == 0
        # Bob still cannot close it; Alice can.
        h3.CloseSession(pb.CloseSessionRequest(session_id=sid, purge=True), timeout=T, metadata=alice)
        assert list_all(h3, metadata=alice) == []


def test_bad_configuration_exits_naming_the_key(model: Path, tmp_path: Path) -> None:
    bad_toml = tmp_path / "h3d.toml"
    bad_toml.write_text('log_level = "info"\nmax_tokenz_limit = 5\n')
    cases = {
        "listen": ["--listen", "0.0.0.0:0"],
        "log_level": ["--log-level", "loud"],
        "max_tokenz_limit": ["--config", str(bad_toml)],
    }
    procs = {
        key: subprocess.Popen(
            serve_cmd(model, tmp_path / key, *flags),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **ENV},
        )
        for key, flags in cases.items()
    }
    for key, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode not in (0, None), (key, out, err)
        assert f"{key}:" in err, (key, out, err)
        assert not (tmp_path / key / "h3d.sock").exists()


# ---- 8: health and reflection -------------------------------------------------------------------


def test_health_and_reflection(main_daemon: RunningDaemon) -> None:
    for service in ("", "h3.v1.H3", "h3.v1.H3Admin"):
        assert health(main_daemon, service) == health_pb2.HealthCheckResponse.SERVING
    code, _ = code_of(lambda: health(main_daemon, "no.such.Service"))
    assert code == Code.NOT_FOUND

    stub = reflection_pb2_grpc.ServerReflectionStub(main_daemon.channel())
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="h3.v1.H3"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=T))
    names = {s.name for s in listed.list_services_response.service}
    assert {"h3.v1.H3", "h3.v1.H3Admin", "grpc.health.v1.Health"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(b)
        for b in described.file_descriptor_response.file_descriptor_proto
    ]
    services = {s.name for f in files if f.package == "h3.v1" for s in f.service}
    assert services == {"H3", "H3Admin"}


# ---- 9: metrics and log events ------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} missing from /metrics")


def test_metrics_and_log_events(main_daemon: RunningDaemon) -> None:
    d = main_daemon
    (listening,) = wait_for(lambda: d.events("metrics_listening"), what="metrics_listening")
    url = f"http://{listening['address']}/metrics"
    h3 = d.h3()
    sid = new_session(h3, TEXTS[0])
    before = h3.GetStats(pb.GetStatsRequest(), timeout=T).throughput
    stream = generate(h3, sid, 8)
    assert stream.done.completion_tokens == 8
    after = h3.GetStats(pb.GetStatsRequest(), timeout=T).throughput
    # One stream alone: a step per token (its context's last token is fed by the first).
    assert after.steps_total - before.steps_total == 8
    assert after.generated_tokens_total - before.generated_tokens_total == 8

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=T) as resp:
            assert resp.status == 200
            return str(resp.read().decode())

    # The handler records its RPC after the stream's last message: poll.
    def recorded() -> str | None:
        text = scrape()
        return text if 'h3d_rpc_total{api="grpc",method="Generate",code="OK"}' in text else None

    text = wait_for(recorded, what="the Generate in h3d_rpc_total")
    assert 0.0 <= _metric(text, "h3d_hbm_hit_rate") <= 1.0
    assert _metric(text, "h3d_ddr_evict_total") >= 0
    for direction in ("up", "down"):  # what the tiers copied between HBM and DDR, as GetStats says after
        copied = _metric(text, f'h3d_tier_copy_bytes_total{{direction="{direction}"}}')
        assert 0 <= copied <= getattr(getattr(h3.GetStats(pb.GetStatsRequest(), timeout=T), "global"),
                                      f"copy_{direction}_bytes")  # fmt: skip
    assert _metric(text, "h3d_generated_tokens_total") >= 8
    assert _metric(text, 'h3d_rpc_total{api="grpc",method="Generate",code="OK"}') >= 1
    assert _metric(text, "h3d_sessions") >= 1
    assert _metric(text, "h3d_ttft_seconds_count") >= 1
    # Where the generation's time to first token went: its parts within the whole
    done = wait_for(lambda: [e for e in d.events("generation") if e.get("session_id") == sid], what="generation")[-1]
    assert done["tokens"] == 8 and done["prompt_tokens"] == stream.done.prompt_tokens
    assert 0 <= done["queued_ms"] <= done["ttft_ms"] and done["prefill_ms"] == 0  # (no prompt with it)
    assert done["ttft_ms"] == pytest.approx(stream.done.ttft_s * 1e3, abs=0.01)
    stats = h3.GetStats(pb.GetStatsRequest(), timeout=T)
    assert _metric(text, "h3d_generated_tokens_total") <= stats.throughput.generated_tokens_total
    assert after.steps_total <= _metric(text, "h3d_steps_total") <= stats.throughput.steps_total
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"http://{listening['address']}/nothing", timeout=T)
    assert missing.value.code == 404

    tier = wait_for(lambda: d.events("tier_stats"), what="a tier_stats event")[-1]
    assert 0.0 <= tier["hbm_hit_rate"] <= 1.0 and tier["ddr_evict_count"] >= 0
    rpcs = wait_for(
        lambda: [e for e in d.events("rpc") if e.get("session_id") == sid and e.get("method") == "Generate"],
        what="the Generate's rpc event",
    )
    assert rpcs[0]["code"] == "OK" and rpcs[0]["ms"] > 0 and rpcs[0]["level"] == "info"


# ---- 10: SIGHUP reloads the configuration file --------------------------------------------------


def test_sighup_reloads_max_tokens_limit(model: Path, tmp_path: Path) -> None:
    config = tmp_path / "h3d.toml"
    config.write_text('log_level = "info"\nmax_tokens_limit = 100\n')
    with running_daemon(model, tmp_path / "d", extra=["--config", str(config)], tcp=False, env=ENV) as d:
        h3, admin = d.h3(), d.admin()
        sid = new_session(h3, TEXTS[1])
        code, details = code_of(lambda: generate(h3, sid, 150))
        assert code == Code.INVALID_ARGUMENT and "1..100" in details

        config.write_text('log_level = "info"\nmax_tokens_limit = 200\n')
        d.proc.send_signal(signal.SIGHUP)
        (reloaded,) = wait_for(lambda: d.events("reloaded"), what="the reloaded event")
        assert reloaded["changed"] == ["max_tokens_limit"] and reloaded["need_restart"] == []
        assert json.loads(admin.GetConfig(pb.GetConfigRequest(), timeout=T).json)["max_tokens_limit"] == 200
        stream = generate(h3, sid, 150)
        assert stream.done.finish_reason == pb.FINISH_REASON_LENGTH and stream.done.completion_tokens == 150
        assert code_of(lambda: generate(h3, sid, 201))[0] == Code.INVALID_ARGUMENT


# ---- ForkSession ---------------------------------------------------------------------------------


def test_fork_session_is_ready_and_continues_as_an_unshared_session(main_daemon: RunningDaemon, model: Path) -> None:
    h3 = main_daemon.h3()
    sid = new_session(h3)
    ids = [3 + (i * 53) % (VOCAB - 3) for i in range(600)]
    assert list(h3.AppendContext(pb.AppendContextRequest(session_id=sid, token_ids=ids), timeout=T))[-1].done
    whole = h3.ForkSession(pb.ForkSessionRequest(session_id=sid), timeout=T)
    assert whole.session_id != sid and whole.num_tokens == 600
    assert whole.cached_tokens == 599 and not whole.busy  # ready: only its last token is left to the next request
    part = h3.ForkSession(pb.ForkSessionRequest(session_id=sid, at_tokens=300), timeout=T)
    assert part.num_tokens == 300 and part.cached_tokens == 299
    got = h3.GetSession(pb.GetSessionRequest(session_id=part.session_id, with_tokens=True), timeout=T)
    assert list(got.token_ids) == ids[:300]
    listed = {s.session_id for s in h3.ListSessions(pb.ListSessionsRequest(), timeout=T).sessions}
    assert {sid, whole.session_id, part.session_id} <= listed
    # The oracle: the in-process engine computing every token (a session of the daemon would find the
    # parent's prefix and copy it too)
    engine = Engine(EngineConfig.build(model=str(model), share_prefixes="off"))
    want = {}
    for n in (600, 300):
        esid = engine.create_session()
        engine.append(esid, token_ids=ids[:n])
        want[n] = list(engine.complete(esid, "", SamplingParams(max_tokens=12, ignore_eos=True)).token_ids)
    engine.close()
    assert generate(h3, whole.session_id, 12).ids == want[600] == generate(h3, sid, 12).ids
    assert generate(h3, part.session_id, 12).ids == want[300]
    assert code_of(lambda: h3.ForkSession(pb.ForkSessionRequest(session_id=sid, at_tokens=10_000), timeout=T)) == (
        Code.INVALID_ARGUMENT, "at_tokens: 10000 is past the session's context (612 tokens)"
    )  # fmt: skip
    assert code_of(lambda: h3.ForkSession(pb.ForkSessionRequest(session_id="f" * 32), timeout=T))[0] == Code.NOT_FOUND
    events = [e for e in main_daemon.logs if e.get("event") == "session_forked" and e.get("parent") == sid]
    # The whole fork holds all the parent's KV (its twin); the other, whole blocks of 32 tokens (the
    # default) up to 64 before its last token
    assert [e["kv_shared_tokens"] for e in events] == [599, (300 - 1 - 64) // 32 * 32]
    for s in (whole.session_id, part.session_id):
        h3.CloseSession(pb.CloseSessionRequest(session_id=s, purge=True), timeout=T)


# ---- 11: AppendContext streams progress ---------------------------------------------------------


def test_append_context_streams_progress(main_daemon: RunningDaemon) -> None:
    h3 = main_daemon.h3()
    sid = new_session(h3)
    ids = [3 + (i * 37) % (VOCAB - 3) for i in range(600)]
    msgs = list(h3.AppendContext(pb.AppendContextRequest(session_id=sid, token_ids=ids), timeout=T))
    progress = [m.progress for m in msgs[:-1]]
    assert progress and all(m.HasField("progress") for m in msgs[:-1])
    assert all(0 < p.tokens_done <= p.tokens_total for p in progress)
    assert [p.tokens_done for p in progress] == sorted(p.tokens_done for p in progress)
    assert progress[0].tokens_done < progress[0].tokens_total  # 600 tokens take two chunks of 512
    assert progress[-1].tokens_done == progress[-1].tokens_total
    assert msgs[-1].HasField("done")
    assert msgs[-1].done.tokens_added == 600 and msgs[-1].done.num_tokens == 600
    session = h3.GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True), timeout=T)
    assert list(session.token_ids) == ids
