"""Chat sessions, Resume, bounded input and the owner map, through a real daemon (tests/live_daemon.py).

Chat's oracle is `h3d generate --chat` on the same model: the conversation rendered at once.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_daemon import RunningDaemon, running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.config import EngineConfig
from h3d.daemon.auth import LOCAL, Auth, Caller
from h3d.daemon.config import DaemonConfig
from h3d.daemon.metrics import Metrics
from h3d.daemon.rpc import State
from h3d.daemon.service import H3Servicer
from h3d.daemon.worker import EngineWorker
from h3d.engine.engine import Engine
from h3d.engine.session import NewSession

MODEL = "llama_gqa4_tied"


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint(MODEL)


@pytest.fixture(scope="module")
def d(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with running_daemon(model, tmp_path_factory.mktemp("h3d"), tcp=False) as daemon:
        yield daemon


def generate_chat(model: Path, prompt: str, n: int) -> list[int]:
    cmd = [sys.executable, "-m", "h3d.cli", "generate", "--model", str(model), "--chat", "--prompt", prompt,
           "--max-tokens", str(n), "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    return list(json.loads(out.strip().splitlines()[-1])["token_ids"])


def stream_tokens(responses: Iterator[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses if r.HasField("delta") for t in r.delta.token_ids]


def test_chat_generate_equals_h3d_generate_chat(d: RunningDaemon, model: Path) -> None:
    stub = d.h3()
    s = stub.CreateSession(pb.CreateSessionRequest(chat=True))
    assert s.chat
    got = stream_tokens(
        stub.Generate(
            pb.GenerateRequest(session_id=s.session_id, prompt="Once upon a time", sampling={"max_tokens": 8})
        )
    )
    assert got == generate_chat(model, "Once upon a time", 8) and got
    shown = stub.GetSession(pb.GetSessionRequest(session_id=s.session_id))
    assert shown.num_messages == 2  # the user's message and the assistant's turn


def test_chat_roles_are_checked(d: RunningDaemon) -> None:
    stub = d.h3()
    plain = stub.CreateSession(pb.CreateSessionRequest()).session_id
    chat = stub.CreateSession(pb.CreateSessionRequest(chat=True, system_prompt="Be brief.")).session_id
    for sid, req, code in (
        (plain, {"text": "hi", "role": "user"}, grpc.StatusCode.INVALID_ARGUMENT),
        (chat, {"text": "hi", "role": "narrator"}, grpc.StatusCode.INVALID_ARGUMENT),
        (chat, {"token_ids": [5]}, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.AppendContext(pb.AppendContextRequest(session_id=sid, **req)))
        assert e.value.code() == code, req
    done = list(stub.AppendContext(pb.AppendContextRequest(session_id=chat, text="It was late.", role="assistant")))
    assert done[-1].done.tokens_added > 0
    assert stub.GetSession(pb.GetSessionRequest(session_id=chat)).num_messages == 2


def test_session_ids_are_checked_and_never_echoed_whole(d: RunningDaemon) -> None:
    stub = d.h3()
    huge = "x" * 1_000_000
    for bad, code in ((huge, grpc.StatusCode.INVALID_ARGUMENT), ("abc", grpc.StatusCode.INVALID_ARGUMENT),
                      ("0" * 32, grpc.StatusCode.NOT_FOUND)):  # fmt: skip
        with pytest.raises(grpc.RpcError) as e:
            stub.GetSession(pb.GetSessionRequest(session_id=bad))
        assert e.value.code() == code
        assert len(e.value.details() or "") < 200
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateSession(pb.CreateSessionRequest(policy="p" * 100_000))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(e.value.details() or "") < 300
    assert max(len(line) for line in d.raw) < 2000  # the log lines too


def test_resume_undoes_a_drain(d: RunningDaemon) -> None:
    admin, stub = d.admin(), d.h3()
    health = health_pb2_grpc.HealthStub(d.channel())
    admin.Drain(pb.DrainRequest(timeout_s=1))
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        stub.CreateSession(pb.CreateSessionRequest())
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert admin.Resume(pb.ResumeRequest()).was_draining
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    assert stub.CreateSession(pb.CreateSessionRequest()).session_id
    assert not admin.Resume(pb.ResumeRequest()).was_draining


class _LoopOnlyDict(dict):  # type: ignore[type-arg]
    """A dict that records the threads that change it."""

    def __init__(self) -> None:
        super().__init__()
        self.writers: set[int] = set()

    def __setitem__(self, key: object, value: object) -> None:
        self.writers.add(threading.get_ident())
        super().__setitem__(key, value)


def test_the_owner_map_is_written_on_the_event_loop_only(model: Path) -> None:
    """`State.owners` belongs to the event loop (it iterates it for ListSessions and GetStats): a
    write from the engine thread could change it under such an iteration."""
    engine = Engine(EngineConfig.build(model=str(model)))
    config = DaemonConfig(engine=engine.config)

    async def main() -> tuple[set[int], int, int]:
        worker = EngineWorker(engine, asyncio.get_running_loop())
        worker.start()
        try:
            state = State(config, worker, Auth(config), Metrics())
            state.owners = _LoopOnlyDict()  # type: ignore[assignment]
            made = await H3Servicer(state).CreateSession(pb.CreateSessionRequest(), None, Caller(LOCAL, admin=False))
            assert state.owners[made.session_id] == LOCAL  # type: ignore[index]
            engine_thread = await worker.call(lambda e: threading.get_ident())
            return state.owners.writers, threading.get_ident(), engine_thread  # type: ignore[attr-defined]
        finally:
            worker.stop(30)

    writers, loop_thread, engine_thread = asyncio.run(main())
    assert writers == {loop_thread} and engine_thread != loop_thread
    engine.close()


def test_create_session_is_answered_while_the_engine_thread_is_busy(model: Path, tmp_path: Path) -> None:
    """CreateSession waits for no step boundary: with the engine thread held in a command (as in
    a long step), a chat session with a system prompt is made, its token log durable, and the
    answer is the Session that GetSession reads once the engine took it in. A request for it
    (GetSession, AppendContext) runs after the engine took it in; a restart restores it from
    its log as a session made on the engine thread would be."""
    logs = tmp_path / "logs"
    engine = Engine(EngineConfig.build(model=str(model), session_log_path=str(logs)))
    config = DaemonConfig(engine=engine.config)
    system = "You answer in one short sentence."
    sampling = pb.SamplingParams(max_tokens=7, temperature=0.0)

    async def main() -> tuple[pb.Session, pb.Session, bool, list[int]]:
        worker = EngineWorker(engine, asyncio.get_running_loop())
        worker.start()
        held, release = threading.Event(), threading.Event()
        try:
            state = State(config, worker, Auth(config), Metrics())
            servicer = H3Servicer(state)
            worker.post(lambda e: (held.set(), release.wait(30)))  # the engine thread, busy
            assert await asyncio.to_thread(held.wait, 30)
            request = pb.CreateSessionRequest(system_prompt=system, chat=True, policy="exact", sampling=sampling)
            made = await asyncio.wait_for(servicer.CreateSession(request, None, Caller(LOCAL, admin=False)), 30)
            durable = (logs / f"{made.session_id}.h3log").exists()
            taken_in = made.session_id in engine.sessions  # (read while the engine thread still waits)
            release.set()
            asked = pb.GetSessionRequest(session_id=made.session_id)
            got = await servicer.GetSession(asked, None, Caller(LOCAL, admin=False))
            assert not taken_in
            tokens = await worker.call(lambda e: list(e.session(made.session_id).tokens))  # type: ignore[arg-type]
            return made, got, durable, tokens
        finally:
            release.set()
            worker.stop(30)

    made, got, durable, tokens = asyncio.run(main())
    assert durable
    assert made == got  # the answer made off the engine thread is what the engine reads
    assert made.chat and made.num_messages == 1 and made.num_tokens == len(tokens) > 0 and made.policy == "exact"
    assert made.sampling.max_tokens == 7
    oracle = Engine(EngineConfig.build(model=str(model)))
    sid = oracle.create_session(system, chat=True)
    assert oracle.session(sid).tokens == tokens  # tokenized as on the engine thread
    engine.close()
    again = Engine(EngineConfig.build(model=str(model), session_log_path=str(logs)))
    restored = again.session(made.session_id)  # type: ignore[arg-type]
    assert restored.tokens == tokens and restored.chat is not None
    assert restored.chat.messages == oracle.session(sid).chat.messages  # type: ignore[union-attr]
    assert again.kv.policy(restored.seq).name == "exact" and restored.sampling.max_tokens == 7
    again.close()
    oracle.close()


def test_a_session_whose_caller_left_while_it_was_made_is_taken_in_all_the_same(model: Path, tmp_path: Path) -> None:
    """`State.make_session`: a caller cancelled while its session's log is being written leaves a
    session that is durable, so the engine takes it in as well (as a command on the engine's
    thread would have made it): never a log on disk that the engine does not list."""
    logs = tmp_path / "logs"
    engine = Engine(EngineConfig.build(model=str(model), session_log_path=str(logs)))
    config = DaemonConfig(engine=engine.config)

    async def main() -> tuple[str, bool, bool]:
        worker = EngineWorker(engine, asyncio.get_running_loop())
        worker.start()
        entered, release = threading.Event(), threading.Event()
        try:
            state = State(config, worker, Auth(config), Metrics())

            def prepare() -> NewSession:
                entered.set()
                assert release.wait(30)
                return engine.prepare_session(owner=LOCAL)

            task = asyncio.ensure_future(state.make_session(prepare))
            assert await asyncio.to_thread(entered.wait, 30)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            for _ in range(300):  # the log written, then the engine takes the session in
                known = await worker.call(lambda e: sorted(e.sessions))
                if known:
                    break
                await asyncio.sleep(0.1)
            return known[0] if known else "", len(list(logs.glob("*.h3log"))) == 1, bool(known)
        finally:
            release.set()
            worker.stop(30)

    sid, durable, taken_in = asyncio.run(main())
    assert durable and taken_in
    assert (logs / f"{sid}.h3log").exists()
    engine.close()
