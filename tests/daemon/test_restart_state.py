"""What a restart keeps: a session's fields as an operator sees them, and its blocks' way back to HBM.

The oracle is a daemon (or engine) that never restarted, running the same requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from google.protobuf import json_format
from live_daemon import running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.session import SessionId

MODEL = "llama_gqa4_tied"
TEXT = "Paged attention keeps the cache in blocks of a fixed number of tokens. " * 6


def hit_rate(engine: Engine, sid: SessionId, before: tuple[int, int]) -> float:
    """The session's HBM hit rate since the counts `before` (hits, misses)."""
    c = engine.kv.counters(engine.session(sid).seq)
    hits, misses = c.hbm_hits - before[0], c.hbm_misses - before[1]
    return hits / (hits + misses)


def counts(engine: Engine, sid: SessionId) -> tuple[int, int]:
    c = engine.kv.counters(engine.session(sid).seq)
    return (c.hbm_hits, c.hbm_misses) if c else (0, 0)


def rounds(engine: Engine, sid: SessionId, n: int) -> list[float]:
    out = []
    for _ in range(n):
        before = counts(engine, sid)
        engine.complete(sid, " And then", engine.with_sampling(max_tokens=4))
        out.append(hit_rate(engine, sid, before))
    return out


@pytest.mark.parametrize("policy", ["exact", "attention_entropy"])
def test_hit_rate_after_a_restart_converges_to_the_uninterrupted_one(
    checkpoint: Callable[[str], Path], tmp_path: Path, policy: str
) -> None:
    def config(folder: Path) -> EngineConfig:
        return EngineConfig.build(
            model=str(checkpoint(MODEL)),
            policy=policy,
            ssd_path=str(folder / "archive"),
            session_log_path=str(folder / "sessions"),
            window_tokens=512,
            window_min_tokens=512,
        )

    steady = Engine(config(tmp_path / "steady"))
    sid_a = steady.create_session()
    steady.append(sid_a, text=TEXT)
    rounds(steady, sid_a, 2)
    uninterrupted = rounds(steady, sid_a, 3)

    first = Engine(config(tmp_path / "restarted"))
    sid_b = first.create_session()
    first.append(sid_b, text=TEXT)
    rounds(first, sid_b, 2)
    first.checkpoint()
    first.close()
    again = Engine(config(tmp_path / "restarted"))
    after = rounds(again, SessionId(sid_b), 3)
    assert after[0] < 1.0  # the first generation reads what the archive staged into DDR
    assert after[-1] == pytest.approx(uninterrupted[-1])  # then it reads from HBM again
    assert uninterrupted[-1] == 1.0  # everything fits in HBM here
    assert again.session(SessionId(sid_b)).tokens == steady.session(sid_a).tokens


def visible(session: pb.Session) -> dict[str, object]:
    """What `h3ctl session show` shows of a session, less where its blocks are (tiers change)."""
    out = json_format.MessageToDict(session, preserving_proto_field_name=True)
    out.pop("residency", None)
    return out


def test_session_fields_survive_a_restart(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    model = checkpoint(MODEL)
    with running_daemon(model, tmp_path, tcp=False) as d:
        stub, admin = d.h3(), d.admin()
        kept = stub.CreateSession(pb.CreateSessionRequest(policy="exact", sampling=pb.SamplingParams(top_k=7)))
        list(stub.AppendContext(pb.AppendContextRequest(session_id=kept.session_id, text=TEXT)))
        pinned = stub.CreateSession(pb.CreateSessionRequest(chat=True, system_prompt="Be brief."))
        list(stub.Generate(pb.GenerateRequest(session_id=pinned.session_id, prompt="Hi", sampling={"max_tokens": 3})))
        admin.PinSession(pb.PinSessionRequest(session_id=pinned.session_id, ttl_s=3600))
        closed = stub.CreateSession(pb.CreateSessionRequest())
        list(stub.AppendContext(pb.AppendContextRequest(session_id=closed.session_id, text="A short one.")))
        stub.CloseSession(pb.CloseSessionRequest(session_id=closed.session_id))
        ids = [kept.session_id, pinned.session_id, closed.session_id]
        before = {i: visible(stub.GetSession(pb.GetSessionRequest(session_id=i, with_tokens=True))) for i in ids}
    time.sleep(1.1)  # a restart that reset last_used_at would show
    with running_daemon(model, tmp_path, tcp=False) as d:
        stub = d.h3()
        after = {i: visible(stub.GetSession(pb.GetSessionRequest(session_id=i, with_tokens=True))) for i in ids}
    assert after == before
    assert before[pinned.session_id]["pinned"] and before[pinned.session_id]["chat"]
    assert before[closed.session_id]["closed"]
