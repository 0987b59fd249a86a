"""Two daemons and one store (`remote_url`): a session made on daemon A is continued on daemon B
after A stops (SIGTERM: its leases released, B takes over at once), after A is killed during a
stream (B takes over once A's lease expires, with every token A's client was sent), and after a
release; the store refused at start where it may lose writes; a store that goes away ends a sync
stream with UNAVAILABLE, and the daemon recovers when it is back. The reference is an in-process
engine that never stops."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import redis
from helpers import VOCAB_SIZE, random_prompt
from live_daemon import RunningDaemon, running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.remote.local import LocalRedis

MODEL = "llama_long"
MODEL_LAYERS = 3  # (its `Spec`)
LEASE = ["--remote-lease-s", "3", "--remote-timeout-s", "1"]  # (short, and loose enough for a busy host)


def remote(server: LocalRedis, *extra: str) -> list[str]:
    return ["--remote-url", server.url, *LEASE, *extra]


def generate(stub: object, sid: str, n: int) -> list[int]:
    sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: list[int] = []
    for msg in stub.Generate(pb.GenerateRequest(session_id=sid, sampling=sampling), timeout=300):  # type: ignore[attr-defined]
        if msg.HasField("delta"):
            out += list(msg.delta.token_ids)
    return out


def created(d: RunningDaemon, prompt: list[int]) -> str:
    h3 = d.h3()
    sid = h3.CreateSession(pb.CreateSessionRequest()).session_id
    for _ in h3.AppendContext(pb.AppendContextRequest(session_id=sid, token_ids=prompt), timeout=300):
        pass
    return str(sid)


def reference(ckpt: Path, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt`, from an engine that never stops."""
    engine = Engine(EngineConfig.build(model=str(ckpt)))
    sid = engine.create_session()
    engine.append(sid, token_ids=prompt)
    out = list(engine.complete(sid, "", SamplingParams(max_tokens=n, ignore_eos=True)).token_ids)
    engine.close()
    return out


def test_a_session_continues_on_another_daemon(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    ckpt = checkpoint(MODEL)
    prompt = random_prompt(300, VOCAB_SIZE, seed=5)
    want = reference(ckpt, prompt, 24)
    with running_daemon(ckpt, tmp_path / "a", tcp=False, extra=remote(redis_server)) as a:
        sid = created(a, prompt)
        assert generate(a.h3(), sid, 8) == want[:8]
        [connected] = a.events("remote_connected")
        assert connected["durability"] == "appendonly yes, appendfsync always"
        with running_daemon(ckpt, tmp_path / "b", tcp=False, extra=remote(redis_server)) as b:
            seen = b.h3().GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True))
            assert list(seen.token_ids) == prompt + want[:8] and seen.served_by == connected["owner"]
            listed = b.h3().ListSessions(pb.ListSessionsRequest(all=True))
            assert [s.session_id for s in listed.sessions] == [sid] and listed.sessions[0].served_by == seen.served_by
            assert not b.h3().ListSessions(pb.ListSessionsRequest()).sessions  # (B's own: none)
            assert "elsewhere:" in b.ctl("session", "list", "--all").stdout
            with pytest.raises(grpc.RpcError) as held:
                generate(b.h3(), sid, 4)  # A serves it
            assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            released = b.ctl("session", "move", sid, "--to", str(a.socket))  # (from B: it does not serve it)
            assert released.returncode == 1
            moved = a.ctl("session", "move", sid, "--to", str(b.socket))
            assert moved.returncode == 0, moved.stderr
            assert generate(b.h3(), sid, 8) == want[8:16]  # B took it over
            with pytest.raises(grpc.RpcError) as gone:
                a.h3().GetSession(pb.GetSessionRequest(session_id=sid, take_over=True))
            assert gone.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # B serves it now
    # Both stopped (SIGTERM: the KV written to the store, the leases released): a third daemon takes
    # it over, its KV read from the store rather than computed again, the partial last block's too.
    # (B's SIGTERM wrote that block alone, a record a layer: the store had the whole ones from A's
    # release, and B's 8 tokens filled none.)
    [written] = b.events("remote_kv_written")
    assert written["sessions"] == 1 and written["blocks"] == MODEL_LAYERS
    with running_daemon(ckpt, tmp_path / "c", tcp=False, extra=remote(redis_server)) as c:
        taken = c.h3().GetSession(pb.GetSessionRequest(session_id=sid, take_over=True))
        assert taken.num_tokens == 300 + 16 and taken.cached_tokens == 300 + 16 - 1  # (the last: fed next)
        assert generate(c.h3(), sid, 8) == want[16:24]
        assert len(c.wait_events("session_taken_over")) == 1
        g = getattr(c.h3().GetStats(pb.GetStatsRequest()), "global")
        assert g.ssd_read_count > 0 and g.kv_rebuild_blocks == 0


def test_a_daemon_killed_during_streams_loses_no_token_it_sent(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    """kill -9 while A streams 4 generations: once A's lease expires (within remote_lease_s + 5 s)
    B takes each session over, its log holds every token A's clients received (sync: a token is
    sent only once the store holds it), and B continues each as an engine that never stopped. A
    writes every whole block behind (write_behind_dirty_mb 0) and copies it to the store, so B
    reads the prompts' KV from there rather than computing it."""
    ckpt = checkpoint(MODEL)
    prompts = [random_prompt(200, VOCAB_SIZE, seed=60 + i) for i in range(4)]
    with (
        running_daemon(ckpt, tmp_path / "b", tcp=False, extra=remote(redis_server)) as b,
        running_daemon(
            ckpt, tmp_path / "a", tcp=False, extra=remote(redis_server, "--write-behind-dirty-mb", "0"), exit_code=-9
        ) as a,
    ):
        sids = [created(a, p) for p in prompts]
        got: list[list[int]] = [[] for _ in sids]

        def stream(i: int) -> None:
            sampling = pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            with contextlib.suppress(grpc.RpcError):  # (cut by the kill)
                for msg in a.h3().Generate(pb.GenerateRequest(session_id=sids[i], sampling=sampling), timeout=300):
                    if msg.HasField("delta"):
                        got[i] += list(msg.delta.token_ids)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while min(len(g) for g in got) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        # (write-behind makes way for prompts while they wait for their first tokens: kill once A
        # has copied some of their KV to the store, within half a second of them)
        store = redis.Redis.from_url(redis_server.url)
        while not next(store.scan_iter(match="h3d:*:kv:*", count=1000), None) and time.monotonic() < deadline:
            time.sleep(0.02)
        a.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        for t in threads:
            t.join(60)
        a.close_channels()
        assert all(len(g) >= 5 for g in got)
        for sid, prompt, sent in zip(sids, prompts, got, strict=True):
            while True:
                try:
                    taken = b.h3().GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True, take_over=True))
                    break
                except grpc.RpcError as e:  # A's lease, until it expires
                    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION
                    time.sleep(0.1)
            assert time.monotonic() - killed <= 3 + 5  # (within the lease + 5 s)
            tokens = list(taken.token_ids)
            assert tokens[: len(prompt)] == prompt and tokens[len(prompt) : len(prompt) + len(sent)] == sent
            assert generate(b.h3(), sid, 4) == reference(ckpt, tokens, 4)
        taken_over = b.events("session_taken_over")
        assert len(taken_over) == 4 and sum(e["kv_blocks_read"] for e in taken_over) > 0


def test_the_sync_mode_refuses_a_store_that_may_lose_writes(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    redis.Redis.from_url(redis_server.url).config_set("appendfsync", "everysec")
    ckpt = checkpoint(MODEL)
    with (
        pytest.raises(RuntimeError, match="appendfsync everysec") as err,
        running_daemon(ckpt, tmp_path / "a", tcp=False, extra=remote(redis_server)),
    ):
        pass
    assert "remote_log = async" in str(err.value)
    with running_daemon(ckpt, tmp_path / "a", tcp=False, extra=remote(redis_server, "--remote-log", "async")) as d:
        [connected] = d.events("remote_connected")
        assert connected["remote_log"] == "async"


def test_a_store_gone_ends_a_sync_stream_unavailable_and_comes_back(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    ckpt = checkpoint(MODEL)
    prompt = random_prompt(100, VOCAB_SIZE, seed=7)
    # (a long lease: the store's absence must not cost the daemon its session)
    extra = ["--remote-url", redis_server.url, "--remote-lease-s", "30", "--remote-timeout-s", "1"]
    with running_daemon(ckpt, tmp_path / "a", tcp=False, extra=extra) as a:
        sid = created(a, prompt)
        first = generate(a.h3(), sid, 4)
        redis_server.stop()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            generate(a.h3(), sid, 4000)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 10
        deadline = time.monotonic() + 10
        while a.h3().GetSession(pb.GetSessionRequest(session_id=sid)).busy and time.monotonic() < deadline:
            time.sleep(0.1)
        after = a.h3().GetSession(pb.GetSessionRequest(session_id=sid))  # its generation stopped with its stream
        assert not after.busy and after.num_tokens < len(prompt) + 4 + 4000
        assert "remote store" in (err.value.details() or "")
        g = getattr(a.h3().GetStats(pb.GetStatsRequest()), "global")
        assert g.remote_on and g.remote_degraded and g.remote_lag_bytes > 0 and g.remote_degraded_reason
        redis_server.start()
        deadline = time.monotonic() + 15
        while True:  # caught up by itself: the next generation streams again
            try:
                more = generate(a.h3(), sid, 4)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.3)
        tokens = list(a.h3().GetSession(pb.GetSessionRequest(session_id=sid, with_tokens=True)).token_ids)
        assert tokens[: len(prompt) + 4] == prompt + first and tokens[-4:] == more
        log = redis.Redis.from_url(redis_server.url).get(f"h3d:{namespace(a)}:{{{sid}}}:log")
        assert log == (a.data_dir / "sessions" / f"{sid}.h3log").read_bytes()  # the store holds the whole log
        g = getattr(a.h3().GetStats(pb.GetStatsRequest()), "global")
        assert not g.remote_degraded and g.remote_lag_bytes == 0
        shown = a.ctl("stats")
        assert "remote_tier" in shown.stdout and "ok; 0 bytes of logs behind" in shown.stdout
        assert "remote_kv_copy" in shown.stdout and "blocks skipped" in shown.stdout


def namespace(d: RunningDaemon) -> str:
    [connected] = d.events("remote_connected")
    return str(connected["namespace"])


def test_a_daemon_of_another_model_sees_none_of_the_sessions(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    """The store's keys are under the model's fingerprint: a daemon of another model neither reads
    nor takes over a session of this one."""
    with running_daemon(checkpoint(MODEL), tmp_path / "a", tcp=False, extra=remote(redis_server)) as a:
        sid = created(a, random_prompt(50, VOCAB_SIZE, seed=8))
    with running_daemon(checkpoint("llama_gqa4_tied"), tmp_path / "b", tcp=False, extra=remote(redis_server)) as b:
        assert namespace(b) != namespace(a)
        for call in (
            lambda: b.h3().GetSession(pb.GetSessionRequest(session_id=sid)),
            lambda: b.h3().GetSession(pb.GetSessionRequest(session_id=sid, take_over=True)),
            lambda: generate(b.h3(), sid, 2),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_full_store_ends_sync_streams_unavailable_until_it_has_room(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    """`maxmemory` with `noeviction` reached: the store refuses the copies, a sync Generate ends
    with UNAVAILABLE naming why, nothing is lost, and the copies resume once it has room."""
    ckpt = checkpoint(MODEL)
    admin = redis.Redis.from_url(redis_server.url)
    extra = ["--remote-url", redis_server.url, "--remote-lease-s", "30", "--remote-timeout-s", "1"]
    with running_daemon(ckpt, tmp_path / "a", tcp=False, extra=extra) as a:
        sid = created(a, random_prompt(100, VOCAB_SIZE, seed=9))
        used = int(admin.info("memory")["used_memory"])
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", str(used // 2))
        with pytest.raises(grpc.RpcError) as err:
            generate(a.h3(), sid, 4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "maxmemory" in (err.value.details() or "")
        admin.config_set("maxmemory", "0")
        deadline = time.monotonic() + 15
        while True:
            try:
                generate(a.h3(), sid, 4)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline
                time.sleep(0.3)
        log = admin.get(f"h3d:{namespace(a)}:{{{sid}}}:log")
        assert log == (a.data_dir / "sessions" / f"{sid}.h3log").read_bytes()


def test_a_session_is_taken_over_by_its_owner_only(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    """Two daemons with the same client tokens: alice's session, given up by A, is not another
    client's on B (not found, not taken: its lease stays free, it is not listed), and is alice's."""
    ckpt = checkpoint(MODEL)
    tokens = tmp_path / "tokens"
    tokens.write_text("token-alice\ntoken-bob\n")
    extra = remote(redis_server, "--auth-token-file", str(tokens))
    alice, bob = [("authorization", "Bearer token-alice")], [("authorization", "Bearer token-bob")]
    prompt = random_prompt(60, VOCAB_SIZE, seed=9)
    with running_daemon(ckpt, tmp_path / "a", tcp=False, extra=extra) as a:
        h3 = a.h3()
        sid = h3.CreateSession(pb.CreateSessionRequest(), metadata=alice).session_id
        for _ in h3.AppendContext(pb.AppendContextRequest(session_id=sid, token_ids=prompt), metadata=alice):
            pass
    with running_daemon(ckpt, tmp_path / "b", tcp=False, extra=extra) as b:
        h3 = b.h3()
        for call in (
            lambda: h3.GetSession(pb.GetSessionRequest(session_id=sid, take_over=True), metadata=bob),
            lambda: list(h3.Generate(pb.GenerateRequest(session_id=sid), metadata=bob)),
            lambda: h3.GetSession(pb.GetSessionRequest(session_id=sid), metadata=bob),
        ):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert not b.events("session_taken_over")
        assert redis.Redis.from_url(redis_server.url).get(f"h3d:{namespace(b)}:{{{sid}}}:lease") is None
        assert not h3.ListSessions(pb.ListSessionsRequest(all=True), metadata=bob).sessions
        listed = h3.ListSessions(pb.ListSessionsRequest(all=True), metadata=alice).sessions
        assert [s.session_id for s in listed] == [sid]
        taken = h3.GetSession(pb.GetSessionRequest(session_id=sid, take_over=True), metadata=alice)
        assert taken.num_tokens == len(prompt) and len(b.wait_events("session_taken_over")) == 1
