"""Sessions outlive the daemon: token logs, the checkpoint at SIGTERM, recovery after kill -9.

The reference is always the in-process engine on the same tiny checkpoint, never interrupted.
"""

from __future__ import annotations

import contextlib
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from helpers import VOCAB_SIZE, random_prompt
from live_daemon import running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import GenerationDone

MODEL = "llama_long"
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SAMPLING = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _generate(stub: object, sid: str, max_tokens: int = 8) -> list[int]:
    sampling = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for msg in stub.Generate(pb.GenerateRequest(session_id=sid, sampling=sampling), timeout=300):  # type: ignore[attr-defined]
        if msg.HasField("delta"):
            out += list(msg.delta.token_ids)
    return out


def _append(stub: object, sid: str, ids: list[int]) -> None:
    for _ in stub.AppendContext(pb.AppendContextRequest(session_id=sid, token_ids=ids), timeout=300):  # type: ignore[attr-defined]
        pass


def _uninterrupted(ckpt: Path, prompts: list[list[int]], generations: int) -> list[list[list[int]]]:
    """The reference: each prompt appended to a session of an in-process engine that never stops,
    then `generations` greedy generations of 8 tokens, in order."""
    engine = Engine(EngineConfig.build(model=str(ckpt)))
    out = []
    for ids in prompts:
        sid = engine.create_session()
        engine.append(sid, token_ids=ids)
        out.append([list(engine.complete(sid, "", GREEDY).token_ids) for _ in range(generations)])
    engine.close()
    return out


def _sessions(stub: object, prompts: list[list[int]], expected: list[list[list[int]]]) -> list[str]:
    """A session per prompt, appended, then one generation checked against the uninterrupted
    engine's first; their ids."""
    sids = []
    for ids, (first, _) in zip(prompts, expected, strict=True):
        sid = stub.CreateSession(pb.CreateSessionRequest()).session_id  # type: ignore[attr-defined]
        _append(stub, sid, ids)
        assert _generate(stub, sid) == first
        sids.append(sid)
    return sids


def test_sigterm_then_restart_continues_every_session_from_the_archive(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """3 sessions of 3,000 tokens, a generation each, SIGTERM, restart: all 3 are listed, none of
    their KV is recomputed (kv_rebuild_blocks 0, archive reads > 0), and the next generation is
    exactly the uninterrupted engine's."""
    ckpt = checkpoint(MODEL)
    prompts = [random_prompt(3000, VOCAB_SIZE, seed=40 + i) for i in range(3)]
    expected = _uninterrupted(ckpt, prompts, generations=2)

    data = tmp_path / "data"
    with running_daemon(ckpt, data, tcp=False) as d:
        sids = _sessions(d.h3(), prompts, expected)
    [event] = d.events("checkpoint")
    assert event["sessions"] == 3 and event["blocks_written"] > 0

    with running_daemon(ckpt, data, tcp=False) as d:
        h3 = d.h3()
        listed = h3.ListSessions(pb.ListSessionsRequest())
        assert sorted(s.session_id for s in listed.sessions) == sorted(sids)
        assert all(s.num_tokens == 3000 + 8 for s in listed.sessions)
        assert [e["sessions"] for e in d.events("sessions_restored")] == [3]
        for sid, ids, (first, second) in zip(sids, prompts, expected, strict=True):
            full = h3.GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True))
            assert list(full.token_ids) == ids + first
            assert full.cached_tokens == 3000 + 8 - 1  # every token's KV but the last came back
            assert _generate(h3, sid) == second
        stats = getattr(h3.GetStats(pb.GetStatsRequest()), "global")
        assert stats.kv_rebuild_blocks == 0 and stats.ssd_read_count > 0


def test_kill_9_during_the_shutdown_checkpoint_loses_nothing(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """SIGTERM, then kill -9 while the checkpoint may be writing (write-behind off: it has every
    block to write): after the restart every session has its tokens, whatever KV the archive had
    durably is read back (no torn record), the rest is computed again, and the next generation
    equals the uninterrupted engine's."""
    ckpt = checkpoint(MODEL)
    prompts = [random_prompt(1000, VOCAB_SIZE, seed=90 + i) for i in range(3)]
    expected = _uninterrupted(ckpt, prompts, generations=2)
    data = tmp_path / "data"
    with running_daemon(ckpt, data, tcp=False, extra=["--no-write-behind"]) as d:
        sids = _sessions(d.h3(), prompts, expected)
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(30)
        d.proc.returncode = 0  # the fixture's own SIGTERM check does not apply to a killed process
    with running_daemon(ckpt, data, tcp=False) as d:
        h3 = d.h3()
        for sid, ids, (first, second) in zip(sids, prompts, expected, strict=True):
            full = h3.GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True))
            assert list(full.token_ids) == ids + first
            assert _generate(h3, sid) == second


def test_a_shutdown_budget_too_small_leaves_sessions_to_recompute_with_the_same_tokens(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """`--shutdown-budget-s 0`: SIGTERM writes no session's KV; systemd is told how long to wait
    (EXTEND_TIMEOUT_USEC) and how far the checkpoint got (STATUS=), the `checkpoint` event counts
    the blocks left, and after the restart exactly those are computed again from the token logs,
    the next generations equal to the uninterrupted engine's."""
    ckpt = checkpoint(MODEL)
    prompts = [random_prompt(n, VOCAB_SIZE, seed=70 + n) for n in (700, 420)]
    expected = _uninterrupted(ckpt, prompts, generations=2)
    data = tmp_path / "data"
    notify = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(notify))
        listener.settimeout(0.1)
        budget = ["--shutdown-budget-s", "0"]
        with running_daemon(ckpt, data, extra=budget, tcp=False, env={"NOTIFY_SOCKET": str(notify)}) as d:
            sids = _sessions(d.h3(), prompts, expected)
        messages = []
        with contextlib.suppress(TimeoutError):
            while True:
                messages.append(dict(kv.split("=", 1) for kv in listener.recv(4096).decode().split("\n")))
    [event] = d.events("checkpoint")
    bs = EngineConfig().block_size  # the daemon's default
    blocks = sum(-(-(len(ids) + 8) // bs) for ids in prompts)  # every block of both, after 8 tokens each
    assert event["blocks_written"] == 0 and event["budget_s"] == 0
    assert event["sessions_left_to_recompute"] == 2 and event["blocks_left_to_recompute"] == blocks
    told = [m for m in messages if "EXTEND_TIMEOUT_USEC" in m]
    assert len(told) == 3  # before the first session, then after each
    assert all(int(m["EXTEND_TIMEOUT_USEC"]) >= 60_000_000 for m in told)  # the overrun, at least
    assert told[-1]["STATUS"] == f"checkpoint: 2/2 sessions, 0 blocks written, {blocks} left to recompute"

    with running_daemon(ckpt, data, tcp=False) as d:
        h3 = d.h3()
        for sid, (_, second) in zip(sids, expected, strict=True):
            assert _generate(h3, sid) == second
        stats = getattr(h3.GetStats(pb.GetStatsRequest()), "global")
        assert stats.kv_rebuild_blocks == blocks  # what the checkpoint said it left


@pytest.mark.parametrize("write_behind", [False, True])
def test_kill_9_during_streams_loses_no_streamed_token(
    checkpoint: Callable[[str], Path], tmp_path: Path, write_behind: bool
) -> None:
    """kill -9 while 4 streams run (and, with write-behind writing every full block as it is made,
    while archive writes are in flight): every token a client received is in its session's log
    after the restart, and generation continues as the engine continues that log; with
    write-behind the restart reads the sessions' KV back from the archive (no torn record read)."""
    ckpt = checkpoint(MODEL)
    data = tmp_path / "data"
    prompts = [random_prompt(200 + 50 * i, VOCAB_SIZE, seed=60 + i) for i in range(4)]
    received: list[list[int]] = [[] for _ in prompts]
    extra = ["--max-tokens-limit", "5000", "--write-behind-dirty-mb", "0"]
    if not write_behind:
        extra[2:] = ["--no-write-behind"]
    with running_daemon(ckpt, data, tcp=False, extra=extra) as d:
        h3 = d.h3()
        sids = []
        for ids in prompts:
            sid = h3.CreateSession(pb.CreateSessionRequest()).session_id
            _append(h3, sid, ids)
            sids.append(sid)
        started = [threading.Event() for _ in prompts]

        def stream(i: int) -> None:
            sampling = pb.SamplingParams(max_tokens=5000, temperature=0.0, ignore_eos=True)
            try:
                for msg in h3.Generate(pb.GenerateRequest(session_id=sids[i], sampling=sampling)):
                    if msg.HasField("delta"):
                        received[i] += list(msg.delta.token_ids)
                        if len(received[i]) >= 5:
                            started[i].set()
            except grpc.RpcError:
                pass  # the daemon died under it
            finally:
                started[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(120)
        # (write-behind makes way for prompts while they wait for their first tokens: kill once it
        # has written some of the streams' KV, within half a second of them)
        deadline = time.monotonic() + 30
        while write_behind and time.monotonic() < deadline:
            if getattr(h3.GetStats(pb.GetStatsRequest()), "global").write_behind_bytes:
                break
            time.sleep(0.02)
        d.proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        d.proc.wait(30)
        d.proc.returncode = 0  # the fixture's own SIGTERM check does not apply to a killed process
    assert all(len(r) >= 5 for r in received)

    engine = Engine(EngineConfig.build(model=str(ckpt)))
    with running_daemon(ckpt, data, tcp=False) as d:
        h3 = d.h3()
        for sid, ids, got in zip(sids, prompts, received, strict=True):
            logged = list(h3.GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True)).token_ids)
            assert logged[: len(ids)] == ids
            assert logged[len(ids) : len(ids) + len(got)] == got  # every streamed token was logged first
            ref = engine.create_session()
            rid = engine.submit(ref, token_ids=logged, generate=True, params=GREEDY)
            [done] = [e for e in engine.run(rid) if isinstance(e, GenerationDone)]
            assert _generate(h3, sid) == list(done.token_ids)
        stats = getattr(h3.GetStats(pb.GetStatsRequest()), "global")
        assert stats.kv_rebuild_blocks > 0  # nothing was checkpointed: some KV was prefilled again
        assert (stats.ssd_read_count > 0) == write_behind  # what was written behind was read back
    engine.close()


def test_idle_sessions_expire_after_session_ttl_s(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """With session_ttl_s, an idle session is closed: its KV leaves HBM and DDR for the archive, it
    stays listed, and its next request reopens it and continues exactly; a pinned one is kept.
    Closing with purge deletes its log and its archived KV."""
    ckpt = checkpoint(MODEL)
    prompt = random_prompt(200, VOCAB_SIZE, seed=90)
    [want] = _uninterrupted(ckpt, [prompt], generations=2)
    data = tmp_path / "data"
    with running_daemon(ckpt, data, tcp=False, extra=["--session-ttl-s", "1"]) as d:
        h3, admin = d.h3(), d.admin()
        kept = h3.CreateSession(pb.CreateSessionRequest()).session_id
        admin.PinSession(pb.PinSessionRequest(session_id=kept))  # at once: on a loaded host 1 s passes quickly
        idle = h3.CreateSession(pb.CreateSessionRequest()).session_id
        _append(h3, idle, prompt)
        assert _generate(h3, idle) == want[0]
        deadline = time.monotonic() + 60
        while not h3.GetSession(pb.GetSessionRequest(session_id=idle)).closed:
            assert time.monotonic() < deadline, "the idle session never expired"
            time.sleep(0.2)
        assert not h3.GetSession(pb.GetSessionRequest(session_id=kept)).closed
        assert [e["session_id"] for e in d.events("session_expired")] == [idle]
        # (closed at once; its KV parked between steps once write-behind has archived it: a while
        # on a loaded host)
        closed = h3.GetSession(pb.GetSessionRequest(session_id=idle))
        while closed.residency.hbm_blocks or closed.residency.ddr_blocks:
            assert time.monotonic() < deadline, f"the expired session's KV never left HBM and DDR: {closed.residency}"
            time.sleep(0.2)
            closed = h3.GetSession(pb.GetSessionRequest(session_id=idle))
        assert closed.residency.hbm_blocks == closed.residency.ddr_blocks == 0 < closed.residency.ssd_blocks
        assert _generate(h3, idle) == want[1]  # reopened from the archive
        h3.CloseSession(pb.CloseSessionRequest(session_id=idle, purge=True))
        assert not (data / "sessions" / f"{idle}.h3log").exists()
        assert [s.session_id for s in h3.ListSessions(pb.ListSessionsRequest()).sessions] == [kept]
        try:
            h3.GetSession(pb.GetSessionRequest(session_id=idle))
            raise AssertionError("a purged session is still served")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND
        stats = getattr(h3.GetStats(pb.GetStatsRequest()), "global")
        assert stats.kv_rebuild_blocks == 0


def test_a_close_answered_once_queued_is_seen_by_the_next_call(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """CloseSession without purge is answered before its KV has moved (write-behind writes it,
    and the engine parks it between steps); the very next call already finds the session closed.
    A Generate right away reopens it (its KV still where it was unless parked already: the engine
    test in tests/tiers/test_writebehind.py checks that, with no step between); closed again, its KV leaves
    HBM and DDR for the archive once written, and the next Generate reopens it from there. Both
    continue exactly."""
    ckpt = checkpoint(MODEL)
    prompt = random_prompt(200, VOCAB_SIZE, seed=91)
    [want] = _uninterrupted(ckpt, [prompt], generations=3)
    with running_daemon(ckpt, tmp_path / "data", tcp=False) as d:
        h3 = d.h3()
        busy = h3.CreateSession(pb.CreateSessionRequest()).session_id  # another stream keeps steps going
        _append(h3, busy, random_prompt(300, VOCAB_SIZE, seed=92))
        stream = h3.Generate(pb.GenerateRequest(session_id=busy, sampling=pb.SamplingParams(max_tokens=64)))
        next(iter(stream))
        sid = h3.CreateSession(pb.CreateSessionRequest()).session_id
        _append(h3, sid, prompt)
        assert _generate(h3, sid) == want[0]
        h3.CloseSession(pb.CloseSessionRequest(session_id=sid))
        assert h3.GetSession(pb.GetSessionRequest(session_id=sid)).closed
        assert _generate(h3, sid) == want[1]  # reopened at once (parked or not yet: its KV in place then)
        h3.CloseSession(pb.CloseSessionRequest(session_id=sid))
        closed = h3.GetSession(pb.GetSessionRequest(session_id=sid))
        assert closed.closed
        deadline = time.monotonic() + 60
        while closed.residency.hbm_blocks + closed.residency.ddr_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
            closed = h3.GetSession(pb.GetSessionRequest(session_id=sid))
        assert closed.residency.hbm_blocks == closed.residency.ddr_blocks == 0 < closed.residency.ssd_blocks
        assert _generate(h3, sid) == want[2]
        stream.cancel()


def test_a_full_ssd_degrades_the_tier_and_the_daemon_keeps_answering(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """The archive's files cannot grow (RLIMIT_FSIZE on the daemon: its writes fail with EFBIG, as
    they would with ENOSPC on a full disk): every request still succeeds with the right tokens,
    Stats and the log show the degraded SSD tier; once files can grow again, the tier recovers (an
    admin snapshot tries it at once: the test waits on no retry interval)."""
    ckpt = checkpoint(MODEL)
    prompts = [random_prompt(300, VOCAB_SIZE, seed=70 + i) for i in range(3)]
    expected = [first for [first] in _uninterrupted(ckpt, prompts, generations=1)]

    slot_mb = 32 * 2 * 2 * 16 * 4 / 2**20  # one layer's K+V of a 32-token block
    tiers = ["--hbm-mb", str(3 * slot_mb), "--ddr-mb", str(40 * slot_mb), "--ssd-retry-interval-s", "3600"]
    with running_daemon(ckpt, tmp_path / "data", extra=tiers, tcp=False) as d:
        limit = 64 * 1024  # token logs stay smaller; the archive's first segment outgrows it
        _, hard = resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE)
        resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
        h3 = d.h3()
        sids = []
        for ids, want in zip(prompts, expected, strict=True):
            sid = h3.CreateSession(pb.CreateSessionRequest()).session_id
            _append(h3, sid, ids)
            assert _generate(h3, sid) == want
            sids.append(sid)
        stats = getattr(h3.GetStats(pb.GetStatsRequest()), "global")
        assert stats.ssd_degraded and stats.ssd_write_errors > 0 and "File too large" in stats.ssd_degraded_reason
        assert stats.recompute_evict_count > 0
        assert d.events("ssd_degraded")
        # The idle sessions' KV was forgotten; their tokens were not: they continue correctly.
        for sid in sids:
            full = h3.GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True))
            assert len(full.token_ids) == 308

        resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        written = d.admin().SnapshotSession(pb.SnapshotSessionRequest(session_id=sids[-1])).blocks_written
        stats = getattr(h3.GetStats(pb.GetStatsRequest()), "global")
        assert written > 0 and not stats.ssd_degraded and stats.ssd_degraded_reason == ""
        assert _generate(h3, sids[0], max_tokens=1)
        assert d.events("ssd_recovered")
