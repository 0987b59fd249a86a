"""h3ctl against a real `h3d serve` (tests/live_daemon.py) on the tiny llama_gqa4_tied checkpoint.

One module-scoped daemon serves most tests; `test_drain_then_resume` drains it (and resumes it),
so it comes last. Generation is checked token for token against the in-process engine on the same model.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from live_daemon import RunningDaemon, running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.config import EngineConfig
from h3d.ctl import app as ctl_app
from h3d.ctl import client as ctl_client
from h3d.ctl import sessions as ctl_sessions
from h3d.ctl import streams as ctl_streams
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams

MODEL = "llama_gqa4_tied"
TEXT = "The quick brown fox jumps over the lazy dog. A long conversation needs a large cache: every token"
# Several blocks (block_size 32) of context, for the tier moves.
LONG_TEXT = (
    "Paged attention keeps the cache in blocks of a fixed number of tokens. A table per sequence says "
    "which block of the pool holds which part of the sequence, so sequences grow one block at a time. "
) * 2


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint(MODEL)


@pytest.fixture(scope="module")
def d(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with running_daemon(model, tmp_path_factory.mktemp("h3d")) as daemon:
        yield daemon


@pytest.fixture(scope="module")
def engine(model: Path) -> Engine:
    return Engine(EngineConfig.build(model=str(model)))


def ok(d: RunningDaemon, *args: str) -> str:
    r = d.ctl(*args)
    assert r.returncode == 0, f"h3ctl {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr
    return r.stdout


def ok_json(d: RunningDaemon, *args: str) -> dict[str, Any]:
    out = ok(d, "--json", *args)
    assert out.endswith("\n") and out.count("\n") == 1, f"not one line: {out!r}"
    obj = json.loads(out)
    assert isinstance(obj, dict)
    return obj


def failed(d: RunningDaemon, code: int, *args: str) -> subprocess.CompletedProcess[str]:
    r = d.ctl(*args)
    assert r.returncode == code, f"h3ctl {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr
    return r


def new_session(d: RunningDaemon, *args: str) -> str:
    sid = ok_json(d, "session", "create", *args)["session_id"]
    assert isinstance(sid, str)
    return sid


def ctl_alone(*args: str) -> subprocess.CompletedProcess[str]:
    """h3ctl with no daemon behind it."""
    cmd = [sys.executable, "-m", "h3d.ctl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


# ---- no daemon needed ----------------------------------------------------------------------------


def test_unreachable_daemon_is_a_clear_error(tmp_path: Path) -> None:
    r = ctl_alone("--socket", "/nonexistent/sock", "health")
    assert r.returncode == 1
    assert "UNAVAILABLE" in r.stderr and "cannot reach the daemon at unix:/nonexistent/sock" in r.stderr
    assert "is h3d running?" in r.stderr and "Traceback" not in r.stderr
    r = ctl_alone("--json", "--socket", str(tmp_path / "none.sock"), "session", "list")
    assert r.returncode == 1 and r.stdout == ""
    err = json.loads(r.stderr)["error"]
    assert err["code"] == "UNAVAILABLE" and "cannot reach the daemon" in err["message"]


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for args in (
        ("frobnicate",),
        (),
        ("session",),
        ("session", "show"),
        ("generate", "abc"),  # --prompt is required
        ("append", "abc"),  # --text or --file
        ("append", "abc", "--text", "x", "--file", "f"),
        ("evict", "abc", "--to", "hbm"),
        ("pin", "abc", "--ttl", "5", "--unpin"),
        ("generate", "abc", "--prompt", "x", "--max-tokens", "-1"),
        ("generate", "abc", "--prompt", "x", "--top-p", "0"),
        ("stats", "--interval", "0"),
        ("append", "abc", "--text", "x", "--role", "bogus"),
        ("top", "--interval", "0"),
        ("health", "--json"),  # global options go before the command
    ):
        r = ctl_alone("--socket", str(tmp_path / "s"), *args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
    r = ctl_alone("--socket", "a", "--address", "127.0.0.1:1", "health")
    assert r.returncode == 2 and "not both" in r.stderr
    r = ctl_alone("--tls-ca", "ca.pem", "health")
    assert r.returncode == 2 and "--tls-ca needs --address" in r.stderr
    r = ctl_alone("--token-file", str(tmp_path / "missing"), "health")
    assert r.returncode == 2 and "cannot read the token file" in r.stderr
    (tmp_path / "empty").write_text("# nothing\n\n")
    r = ctl_alone("--token-file", str(tmp_path / "empty"), "health")
    assert r.returncode == 2 and "holds no token" in r.stderr


def test_sampling_sets_only_the_fields_given() -> None:
    parser = ctl_app.build_parser()
    sp = ctl_streams.sampling_of(parser.parse_args(["generate", "x", "--prompt", "", "--temperature", "0"]))
    assert sp.HasField("temperature") and sp.temperature == 0
    assert not any(sp.HasField(f) for f in ("max_tokens", "top_p", "top_k", "seed"))
    args = ["generate", "x", "--prompt", "p", "--max-tokens", "5", "--top-p", "0.5", "--top-k", "3", "--seed", "7"]
    sp = ctl_streams.sampling_of(parser.parse_args([*args, "--stop", "a", "--stop", "b"]))
    assert (sp.max_tokens, sp.top_p, sp.top_k, sp.seed, list(sp.stop)) == (5, 0.5, 3, 7, ["a", "b"])
    assert not sp.HasField("temperature")


def test_read_token_skips_blanks_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("\n  # a comment\n\n  s3cret  \nother\n")
    assert ctl_client.read_token(str(path)) == "s3cret"


def test_list_follows_pages() -> None:
    pages = {"": ("a", "2"), "2": ("b", "4"), "4": ("c", "")}
    seen: list[str] = []

    class FakeStub:
        ListSessions = None

    class FakeClient:
        h3 = FakeStub()

        def call(self, method: Any, request: pb.ListSessionsRequest) -> pb.ListSessionsResponse:
            seen.append(request.page_token)
            sid, nxt = pages[request.page_token]
            return pb.ListSessionsResponse(sessions=[pb.Session(session_id=sid)], next_page_token=nxt, total=3)

    fake: Any = FakeClient()
    sessions = ctl_sessions.list_sessions(fake)
    assert [s.session_id for s in sessions] == ["a", "b", "c"]
    assert seen == ["", "2", "4"]


FULL_ID = "0123456789abcdef0123456789abcdef"


class FakeSessions:
    """A client whose ListSessions (two pages) holds `ids`; counts the calls."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = ids
        self.calls = 0
        self.h3 = self

    ListSessions = None

    def call(self, method: Any, request: pb.ListSessionsRequest) -> pb.ListSessionsResponse:
        self.calls += 1
        half = len(self.ids) // 2
        page = self.ids[:half] if not request.page_token else self.ids[half:]
        nxt = "" if request.page_token else "p2"
        return pb.ListSessionsResponse(sessions=[pb.Session(session_id=i) for i in page], next_page_token=nxt)


def test_resolve_id_by_unique_prefix() -> None:
    ids = ["abcd" + "0" * 28, "abef" + "1" * 28, "9" * 32, "5" * 32]
    fake: Any = FakeSessions(ids)
    assert ctl_sessions.resolve_id(fake, "abc") == ids[0]
    assert ctl_sessions.resolve_id(fake, "ABE") == ids[1]  # ids are lowercase hex
    assert ctl_sessions.resolve_id(fake, "5" * 12) == ids[3]  # on the second page; top's 12 digits
    calls = fake.calls
    assert ctl_sessions.resolve_id(fake, FULL_ID) == FULL_ID and fake.calls == calls  # a full id: no lookup
    with pytest.raises(ctl_client.UsageError, match=f"ambiguous session prefix 'ab': matches {ids[0]}, {ids[1]} "):
        ctl_sessions.resolve_id(fake, "ab")
    with pytest.raises(ctl_client.NoSuchSession, match="no session with an id starting with 'abc0f'"):
        ctl_sessions.resolve_id(fake, "abc0f")
    with pytest.raises(ctl_client.UsageError, match="empty"):
        ctl_sessions.resolve_id(fake, "")
    many: Any = FakeSessions([f"{i:02x}" + "0" * 30 for i in range(12)])
    with pytest.raises(ctl_client.UsageError, match=r"matches 00.*, 09\w+ and 2 more"):
        ctl_sessions.resolve_id(many, "0")


def test_every_id_argument_is_resolved(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each command's ID goes through resolve_id before the command runs; the command sees the full id."""
    seen: list[tuple[str, str]] = []
    monkeypatch.setattr(ctl_app, "connect", lambda args: type("C", (), {"close": lambda self: None})())
    monkeypatch.setattr(ctl_app, "resolve_id", lambda c, given: FULL_ID if given == "0123" else given)
    for argv in (
        ["session", "show", "0123"],
        ["session", "close", "0123"],
        ["append", "0123", "--text", "x"],
        ["generate", "0123", "--prompt", "x"],
        ["evict", "0123", "--to", "ddr"],
        ["pin", "0123"],
        ["policy", "0123", "exact"],
    ):
        func = ctl_app.build_parser().parse_args(argv).func
        name = func.__name__

        def command(c: Any, args: Any, name: str = name) -> int:
            seen.append((name, args.id))
            return 0

        monkeypatch.setattr(sys.modules[func.__module__], name, command)  # where its add_parsers finds it
        assert ctl_app.main(argv) == 0
    assert [i for _, i in seen] == [FULL_ID] * 7 and len({n for n, _ in seen}) == 7


def test_role_and_chat_are_sent_only_when_given(monkeypatch: pytest.MonkeyPatch) -> None:
    requests: list[Any] = []

    class Client:
        h3 = type("Stub", (), {"AppendContext": None, "CreateSession": None})()

        def stream(self, method: Any, request: pb.AppendContextRequest) -> Iterator[pb.AppendContextResponse]:
            requests.append(request)
            yield pb.AppendContextResponse(done=pb.AppendSummary(tokens_added=1, num_tokens=1))

        def call(self, method: Any, request: pb.CreateSessionRequest) -> pb.Session:
            requests.append(request)
            return pb.Session(session_id=FULL_ID)

        def close(self) -> None:
            pass

    monkeypatch.setattr(ctl_app, "connect", lambda args: Client())
    assert ctl_app.main(["append", FULL_ID, "--text", "hi"]) == 0
    assert ctl_app.main(["append", FULL_ID, "--text", "hi", "--role", "assistant"]) == 0
    assert ctl_app.main(["session", "create"]) == 0
    assert ctl_app.main(["session", "create", "--chat", "--system", "Be brief."]) == 0
    plain, assistant, create, chat = requests
    assert plain.role == ""  # not sent: the daemon's default (user) applies
    assert plain.SerializeToString() == pb.AppendContextRequest(session_id=FULL_ID, text="hi").SerializeToString()
    assert assistant.role == "assistant"
    assert create.chat is False and create.system_prompt == ""
    assert chat.chat is True and chat.system_prompt == "Be brief."


def test_session_text_says_tokens_and_blocks_per_layer() -> None:
    # 63 tokens, blocks of 32: 2 blocks in each of 30 layers, all in HBM.
    s = pb.Session(session_id=FULL_ID, num_tokens=63, cached_tokens=63, residency=pb.TierResidency(hbm_blocks=60))
    assert ctl_sessions.layers_of([s], 32) == 30
    text = ctl_sessions.session_text(s, 32, 30)
    assert "\ntokens        63 (63 with KV computed)\n" in text
    assert "\nkv_blocks     2 per layer (32 tokens each) x 30 layers = 60\n" in text
    assert "\nresidency     HBM 60, DDR 0, SSD 0 block copies (all layers); per layer HBM 2, DDR 0, SSD 0\n" in text
    assert "\nchat          no\n" in text
    # Without the block size (GetConfig refused): the sums, said to be over the layers.
    assert "HBM 60, DDR 0, SSD 0 block copies (all layers together; a block holds block_size tokens" in (
        ctl_sessions.session_text(s)
    )
    # KV still to compute; a chat session.
    s2 = pb.Session(num_tokens=10, cached_tokens=0, chat=True, num_messages=3)
    text = ctl_sessions.session_text(s2, 32, None)
    assert "10 (0 with KV computed, 10 to compute at the next request)" in text
    assert "kv_blocks     none yet" in text and "\nchat          yes, 3 messages\n" in text


def test_layer_count_from_residencies() -> None:
    def sess(cached: int, hbm: int = 0, ddr: int = 0, ssd: int = 0, busy: bool = False) -> pb.Session:
        r = pb.TierResidency(hbm_blocks=hbm, ddr_blocks=ddr, ssd_blocks=ssd)
        return pb.Session(cached_tokens=cached, residency=r, busy=busy)

    assert ctl_sessions.layers_of([sess(65, ddr=9)], 32) == 3  # 3 blocks per layer, all in DDR
    assert ctl_sessions.layers_of([sess(65, ddr=3, ssd=6)], 32) is None  # 2 or 3 layers
    assert ctl_sessions.layers_of([sess(65, ddr=3, ssd=6), sess(10, hbm=3)], 32) == 3  # the other session decides
    assert ctl_sessions.layers_of([sess(65, hbm=9, ddr=9, busy=True)], 32) is None  # busy: not counted
    assert ctl_sessions.layers_of([sess(0)], 32) is None
    assert ctl_sessions.layers_of([sess(65, hbm=9), sess(10, hbm=4)], 32) is None  # contradictory: unknown


def test_interrupted_stream_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    cancelled: list[bool] = []

    class Call:
        def __iter__(self) -> Iterator[pb.GenerateResponse]:
            yield pb.GenerateResponse(delta=pb.TokenDelta(text="Hel", token_ids=[7]))
            raise KeyboardInterrupt  # Ctrl-C while waiting for the next token

        def cancel(self) -> None:
            cancelled.append(True)

    class Stub:
        Generate = None  # the fake stream ignores the method

    class Client:
        h3 = Stub()

        def stream(self, method: Any, request: pb.GenerateRequest) -> Call:
            assert request.session_id == FULL_ID and request.prompt == "hi"
            return Call()

        def close(self) -> None:
            pass

    monkeypatch.setattr(ctl_app, "connect", lambda args: Client())  # a full id: no ListSessions
    assert ctl_app.main(["generate", FULL_ID, "--prompt", "hi"]) == 130
    out = capsys.readouterr()
    assert out.out == "Hel\n" and out.err == ""
    assert cancelled == [True]


# ---- against the daemon --------------------------------------------------------------------------


def test_health(d: RunningDaemon) -> None:
    assert ok(d, "health") == "SERVING\n"
    assert ok_json(d, "health") == {"status": "SERVING"}


def test_session_create_list_show(d: RunningDaemon) -> None:
    created = ok_json(d, "session", "create")
    sid = created["session_id"]
    assert re.fullmatch(r"[0-9a-f]{32}", sid)
    assert created["num_tokens"] == 0 and created["policy"] == "attention_entropy"
    listed = {s["session_id"]: s for s in ok_json(d, "session", "list")["sessions"]}
    assert listed[sid]["num_tokens"] == 0
    assert listed[sid]["policy"] == "attention_entropy"
    assert isinstance(listed[sid]["created_at"], float) and abs(listed[sid]["created_at"] - time.time()) < 120
    # Human output: the id alone; a table naming it.
    human = ok(d, "session", "create", "--system", "Be brief.", "--policy", "exact").strip()
    assert re.fullmatch(r"[0-9a-f]{32}", human)
    table = ok(d, "session", "list")
    assert table.splitlines()[0].split()[:3] == ["SESSION", "POLICY", "TOKENS"]
    assert any(line.startswith(human) and " exact " in line for line in table.splitlines())
    shown = ok_json(d, "session", "show", human)
    assert shown["policy"] == "exact" and shown["num_tokens"] > 0  # the system prompt
    assert shown["residency"] == {"hbm_blocks": 0, "ddr_blocks": 0, "ssd_blocks": 0}  # prefilled lazily
    assert shown["token_ids"] == [] and shown["text"] == ""  # without --with-tokens
    assert f"session_id    {human}" in ok(d, "session", "show", human)


def test_session_fork(d: RunningDaemon) -> None:
    sid = new_session(d)
    ok_json(d, "append", sid, "--text", TEXT)
    parent = ok_json(d, "session", "show", sid, "--with-tokens")
    fork = ok_json(d, "session", "fork", sid[:8], "--at", "3")  # as `session create` prints it
    assert fork["session_id"] != sid and fork["num_tokens"] == 3 and fork["cached_tokens"] == 2
    assert ok_json(d, "session", "show", fork["session_id"], "--with-tokens")["token_ids"] == parent["token_ids"][:3]
    whole = ok(d, "session", "fork", sid).strip()
    assert re.fullmatch(r"[0-9a-f]{32}", whole)
    assert ok_json(d, "session", "show", whole)["num_tokens"] == parent["num_tokens"]
    r = d.ctl("session", "fork", sid, "--at", str(parent["num_tokens"] + 1))
    assert r.returncode == 1 and "at_tokens" in r.stderr and "Traceback" not in r.stderr
    r = d.ctl("session", "fork", sid, "--at", "-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_generate_matches_the_engine(d: RunningDaemon, engine: Engine) -> None:
    esid = engine.create_session()
    engine.append(esid, text=TEXT)
    appended = list(engine.session(esid).tokens)
    assert appended == engine.tokenizer.encode(TEXT)
    done = engine.complete(esid, "", SamplingParams(max_tokens=8))
    assert len(done.token_ids) >= 1

    sid = new_session(d)
    summary = ok_json(d, "append", sid, "--text", TEXT)
    assert summary["tokens_added"] == len(appended) and summary["num_tokens"] == len(appended)
    assert summary["prefill_s"] > 0
    out = ok_json(d, "generate", sid, "--prompt", "", "--max-tokens", "8", "--temperature", "0")
    assert out["token_ids"] == list(done.token_ids)
    assert out["text"] == done.text
    assert out["finish_reason"] == done.finish_reason.name.lower()
    assert out["completion_tokens"] == len(done.token_ids)
    assert out["prompt_tokens"] == len(appended)
    assert out["ttft_s"] > 0 and out["tokens_per_s"] >= 0

    shown = ok_json(d, "session", "show", sid, "--with-tokens")
    assert shown["token_ids"] == appended + list(done.token_ids) == engine.session(esid).tokens
    assert shown["text"] == engine.tokenizer.decode(engine.session(esid).tokens)
    assert shown["num_tokens"] == len(shown["token_ids"])
    engine.close_session(esid)

    # Streaming: the deltas' text, then a newline; human append prints a summary line.
    sid2 = new_session(d)
    human = ok(d, "append", sid2, "--text", TEXT)
    n = len(appended)
    assert re.fullmatch(rf"appended {n} tokens in [0-9.]+ s \(the context holds {n} tokens\)\n", human)
    streamed = ok(d, "generate", sid2, "--prompt", "", "--max-tokens", "8", "--temperature", "0")
    assert streamed == done.text + "\n"


def test_generate_with_a_prompt_and_limits(d: RunningDaemon, engine: Engine) -> None:
    # `generate --prompt T` on an empty session is `append T` then generate.
    esid = engine.create_session()
    done = engine.complete(esid, TEXT, SamplingParams(max_tokens=3))
    engine.close_session(esid)
    sid = new_session(d)
    out = ok_json(d, "generate", sid, "--prompt", TEXT, "--max-tokens", "3", "--temperature", "0")
    assert out["token_ids"] == list(done.token_ids) and out["completion_tokens"] <= 3
    if len(done.token_ids) == 3:
        assert out["finish_reason"] == "length"
    # Seeded sampling is reproducible across sessions.
    runs = []
    for _ in range(2):
        s = new_session(d)
        args = ("--prompt", TEXT, "--max-tokens", "4", "--temperature", "1.5", "--top-p", "0.9", "--seed", "11")
        runs.append(ok_json(d, "generate", s, *args)["token_ids"])
    assert runs[0] == runs[1] and len(runs[0]) >= 1


def test_errors_from_the_daemon(d: RunningDaemon) -> None:
    r = failed(d, 1, "session", "show", "nonexistent")
    assert r.stderr.startswith("h3ctl: error: NOT_FOUND: ") and "nonexistent" in r.stderr
    assert r.stdout == ""
    r = failed(d, 1, "--json", "session", "show", "nonexistent")
    err = json.loads(r.stderr)["error"]
    assert err["code"] == "NOT_FOUND" and "nonexistent" in err["message"]
    sid = new_session(d)
    ok(d, "append", sid, "--text", "Hello")
    r = failed(d, 1, "generate", sid, "--prompt", "x", "--max-tokens", "0")
    assert "INVALID_ARGUMENT" in r.stderr and "max_tokens" in r.stderr
    r = failed(d, 1, "--json", "generate", sid, "--prompt", "x", "--max-tokens", "0")
    assert json.loads(r.stderr)["error"]["code"] == "INVALID_ARGUMENT" and r.stdout == ""
    r = failed(d, 1, "generate", new_session(d), "--prompt", "")  # nothing to continue
    assert "INVALID_ARGUMENT" in r.stderr
    r = failed(d, 1, "session", "create", "--policy", "bogus")
    assert "INVALID_ARGUMENT" in r.stderr and "bogus" in r.stderr


def test_health_config_stats_top(d: RunningDaemon) -> None:
    config = ok_json(d, "config")
    assert config["block_size"] == 32 and config["socket"] == str(d.socket)
    assert config["ddr_mb"] == "auto" and config["resolved"]["ddr_mb"] == 4096.0  # as configured, and as sized
    pretty = ok(d, "config")
    assert pretty.count("\n") > 10 and json.loads(pretty) == config

    sid = new_session(d)
    added = ok_json(d, "append", sid, "--text", TEXT)["tokens_added"]
    stats = ok_json(d, "stats")
    assert 0 <= stats["global"]["hbm_hit_rate"] <= 1
    assert stats["global"]["hbm_capacity_bytes"] > 0
    assert stats["throughput"]["sessions"] >= 1 and stats["draining"] is False
    assert sid in {s["session_id"] for s in stats["sessions"]}
    human = ok(d, "stats")
    for key in ("hbm_hit_rate", "ddr_evict_count", "ssd_read_count", "hbf_latency_us", "occupancy_mib"):
        assert key in human
    # within its 1 GiB budget, nothing of this small session is written behind
    assert "0.0 in flight, 0.0 written; lag 0.0s" in human and stats["global"]["dirty_bytes"] > 0
    assert "read_ahead_mib" in human and "0.0 read back, 0.0 in flight" in human  # nothing resumed
    assert "tokens_per_s" in human and "in_flight" in human
    assert "graphs" in human and "after ready" in human  # the CPU captures none: "0 captured"

    top = ok(d, "top", "--once")
    assert top.startswith("h3d  up ") and "SESSION" in top
    row = next(line for line in top.splitlines() if line.startswith(sid[:12]))
    assert sid not in row  # the id's prefix only
    cells = row.split()  # SESSION POLICY/WINDOW TOKENS HBM HBM-SHARE DDR SSD HIT ITL BUSY
    assert cells[1].startswith("attention_entropy/") and cells[2] == str(added)
    # No share (no request in flight), no token generated yet, not busy.
    assert int(cells[3]) > 0 and cells[4] == "-" and cells[8] == "-" and cells[9] == "-"
    # 32 tokens: the first message may carry several (the loop behind the engine), gaps of 0 each
    ok(d, "generate", sid, "--prompt", " and", "--max-tokens", "32")
    row = next(line for line in ok(d, "top", "--once").splitlines() if line.startswith(sid[:12]))
    p50, p99 = map(float, row.split()[8].split("/"))
    assert 0 < p50 <= p99


def _ctrl_c_on() -> None:
    """In the child before h3ctl starts: SIGINT at its default, so that Python turns it into
    KeyboardInterrupt as a terminal's Ctrl-C would, even where the tests run with SIGINT ignored
    (a shell's background job: the children would inherit that, and ignore it too)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_stats_watch_until_interrupted(d: RunningDaemon) -> None:
    cmd = [sys.executable, "-m", "h3d.ctl", "--socket", str(d.socket), "--json", "stats", "--watch"]
    proc = subprocess.Popen(
        [*cmd, "--interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_on
    )
    assert proc.stdout is not None
    lines = [proc.stdout.readline() for _ in range(3)]
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    frames = [json.loads(line) for line in lines + rest.splitlines() if line.strip()]
    assert len(frames) >= 3 and all("hbm_hit_rate" in f["global"] for f in frames)


def test_evict_pin_policy_close(d: RunningDaemon) -> None:
    sid = new_session(d)
    ok(d, "append", sid, "--text", LONG_TEXT)
    before = ok_json(d, "session", "show", sid)["residency"]
    assert before["hbm_blocks"] > 0

    moved = ok_json(d, "evict", sid, "--to", "ddr")
    assert moved["blocks_moved"] > 0 and moved["residency"]["hbm_blocks"] == 0
    after = ok_json(d, "session", "show", sid)["residency"]
    assert after["hbm_blocks"] == 0 and after["ddr_blocks"] > 0
    assert "moved 0 block copies to DDR" in ok(d, "evict", sid, "--to", "ddr")  # nothing left to move

    archived = ok_json(d, "evict", sid, "--to", "ssd")
    assert archived["residency"]["ssd_blocks"] > 0
    assert ok_json(d, "session", "show", sid)["residency"]["ssd_blocks"] > 0

    pinned = ok_json(d, "pin", sid, "--ttl", "60")
    assert pinned["pinned"] is True and 50 < pinned["pinned_until"] - time.time() <= 61
    assert ok_json(d, "session", "show", sid)["pinned"] is True
    assert ok(d, "pin", sid).strip() == f"pinned {sid} until unpinned"
    assert ok_json(d, "pin", sid, "--unpin")["pinned"] is False

    assert ok(d, "policy", sid, "exact").strip() == f"{sid}: policy exact"
    assert ok_json(d, "session", "show", sid)["policy"] == "exact"
    assert ok_json(d, "policy", sid, "fixed")["policy"] == "fixed"
    r = failed(d, 1, "policy", sid, "nonsense")
    assert "INVALID_ARGUMENT" in r.stderr

    assert ok(d, "session", "close", sid).strip() == f"closed {sid}"
    shown = ok_json(d, "session", "show", sid)
    assert shown["closed"] is True and shown["residency"]["hbm_blocks"] == shown["residency"]["ddr_blocks"] == 0
    assert "closed" in ok(d, "session", "list") and "reopens" in ok(d, "session", "show", sid)
    assert ok(d, "session", "close", sid, "--purge").strip() == f"purged {sid}"
    r = failed(d, 1, "session", "show", sid)
    assert "NOT_FOUND" in r.stderr
    assert sid not in ok(d, "session", "list")
    assert "NOT_FOUND" in failed(d, 1, "session", "close", sid).stderr


def test_ids_by_unique_prefix(d: RunningDaemon) -> None:
    sid = new_session(d)
    short = sid[:12]  # what `top` shows
    assert ok_json(d, "session", "show", short)["session_id"] == sid
    assert ok(d, "session", "show", sid[:5]).startswith(f"session_id    {sid}\n")
    assert ok_json(d, "append", short, "--text", LONG_TEXT)["session_id"] == sid
    out = ok_json(d, "generate", short, "--prompt", "", "--max-tokens", "2", "--temperature", "0")
    assert out["session_id"] == sid and out["completion_tokens"] >= 1
    assert ok_json(d, "evict", short, "--to", "ddr")["blocks_moved"] > 0
    assert ok(d, "pin", short).strip() == f"pinned {sid} until unpinned"
    assert ok_json(d, "pin", short, "--unpin")["pinned"] is False
    assert ok(d, "policy", short, "exact").strip() == f"{sid}: policy exact"
    assert ok(d, "session", "close", short).strip() == f"closed {sid}"

    # Ambiguous: sessions until two share a first digit (16 digits: at most 17 sessions).
    by_digit: dict[str, list[str]] = {}
    for s in (x["session_id"] for x in ok_json(d, "session", "list")["sessions"]):
        by_digit.setdefault(s[0], []).append(s)
    while max(len(v) for v in by_digit.values()) < 2:
        s = new_session(d)
        by_digit.setdefault(s[0], []).append(s)
    digit, shared = next((k, sorted(v)) for k, v in by_digit.items() if len(v) >= 2)
    r = failed(d, 2, "session", "show", digit)
    assert r.stderr.startswith(f"h3ctl: error: ambiguous session prefix '{digit}': matches {shared[0]}, {shared[1]}")
    assert r.stdout == ""
    assert failed(d, 2, "append", digit, "--text", "x").stderr.startswith("h3ctl: error: ambiguous")

    # No match: NOT_FOUND, as the daemon's own.
    known = [x["session_id"] for x in ok_json(d, "session", "list")["sessions"]]
    missing = next(p for p in (uuid.uuid4().hex[:20] for _ in range(100)) if not any(k.startswith(p) for k in known))
    r = failed(d, 1, "session", "show", missing)
    assert r.stderr == f"h3ctl: error: NOT_FOUND: no session with an id starting with '{missing}'\n"
    r = failed(d, 1, "--json", "pin", missing)
    assert json.loads(r.stderr)["error"]["code"] == "NOT_FOUND"
    # A full id is sent as is: the daemon's own NOT_FOUND.
    r = failed(d, 1, "session", "show", uuid.uuid4().hex)
    assert "NOT_FOUND" in r.stderr and "starting with" not in r.stderr


def test_session_show_in_words(d: RunningDaemon) -> None:
    sid = new_session(d)
    ok(d, "append", sid, "--text", f"{sid}: {LONG_TEXT}")  # (its own first block: no prefix shared)
    shown = ok_json(d, "session", "show", sid)
    cached, res = shown["cached_tokens"], shown["residency"]
    blocks = -(-cached // 32)  # block_size 32; the model has 3 layers
    assert blocks >= 2 and res == {"hbm_blocks": 3 * blocks, "ddr_blocks": 0, "ssd_blocks": 0}
    lines = ok(d, "session", "show", sid).splitlines()
    assert f"tokens        {shown['num_tokens']} ({cached} with KV computed" in lines[1]
    assert lines[2] == f"kv_blocks     {blocks} per layer (32 tokens each) x 3 layers = {3 * blocks}"
    assert lines[3] == (
        f"residency     HBM {3 * blocks}, DDR 0, SSD 0 block copies (all layers); per layer HBM {blocks}, DDR 0, SSD 0"
    )
    assert lines[4] == "chat          no"
    ok(d, "evict", sid, "--to", "ddr")
    assert f"per layer HBM 0, DDR {blocks}, SSD 0" in ok(d, "session", "show", sid)
    assert ok_json(d, "session", "show", sid)["residency"]["ddr_blocks"] == 3 * blocks  # --json: the proto
    empty = ok(d, "session", "show", new_session(d))
    assert "\ntokens        0\nkv_blocks     none\n" in empty


def top_on_a_pty(d: RunningDaemon, stop: str) -> None:
    """`top` with a pseudo-terminal as stdin and stdout; once it has drawn a frame, `stop` it
    ("q": the key; "SIGINT": Ctrl-C). It must exit 0 within 5 s with the terminal as it was."""
    master, slave = pty.openpty()
    before = termios.tcgetattr(slave)
    cmd = [sys.executable, "-m", "h3d.ctl", "--socket", str(d.socket), "top", "--interval", "0.2"]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, preexec_fn=_ctrl_c_on)
    out = bytearray()

    def pump(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if select.select([master], [], [], 0.05)[0]:
                out.extend(os.read(master, 65536))

    try:
        deadline = time.monotonic() + 60
        while b"q quits" not in out and time.monotonic() < deadline and proc.poll() is None:
            pump(0.1)
        assert b"q quits" in out, out.decode(errors="replace")
        assert not termios.tcgetattr(slave)[3] & (termios.ICANON | termios.ECHO)  # cbreak, no echo
        t0 = time.monotonic()
        if stop == "q":
            os.write(master, b"q")
        else:
            proc.send_signal(signal.SIGINT)
        while proc.poll() is None and time.monotonic() - t0 < 5:
            pump(0.05)
        assert proc.returncode == 0, out.decode(errors="replace")
        assert b"Traceback" not in out
        assert termios.tcgetattr(slave) == before  # restored
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
        os.close(slave)


def test_top_quits_on_q(d: RunningDaemon) -> None:
    """On a terminal `top` reads keys (cbreak mode): `q` ends it, and the terminal is restored;
    so does Ctrl-C."""
    top_on_a_pty(d, "q")
    top_on_a_pty(d, "SIGINT")
    # Not on a terminal: no key reading, Ctrl-C as before (the footer says so).
    cmd = [sys.executable, "-m", "h3d.ctl", "--socket", str(d.socket), "top", "--interval", "0.2"]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_on
    )
    assert proc.stdout is not None
    while "quits" not in (line := proc.stdout.readline()):
        assert line, "top ended"
    assert line.strip() == "every 0.2s; Ctrl-C quits"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err


def test_chat_sessions(d: RunningDaemon, engine: Engine) -> None:
    """Needs the daemon's chat sessions (CreateSessionRequest.chat, AppendContextRequest.role)."""
    created = ok_json(d, "session", "create", "--chat", "--system", "Answer briefly.")
    sid = created["session_id"]
    assert created["chat"] is True
    out = ok_json(d, "generate", sid[:8], "--prompt", "Once upon a time", "--max-tokens", "6", "--temperature", "0")
    esid = engine.create_session(system_prompt="Answer briefly.", chat=True)
    done = engine.complete(esid, "Once upon a time", SamplingParams(max_tokens=6))
    assert out["token_ids"] == list(done.token_ids)  # the prompt went in as a user message
    ok(d, "append", sid, "--text", "It was late.", "--role", "assistant")
    engine.append(esid, text="It was late.", role="assistant")
    ok(d, "append", sid, "--text", "Go on.")  # role: user (the default)
    engine.append(esid, text="Go on.")
    shown = ok_json(d, "session", "show", sid, "--with-tokens")
    assert shown["token_ids"] == list(engine.session(esid).tokens)
    n = shown["num_messages"]
    assert shown["chat"] is True and n >= 4
    assert f"\nchat          yes, {n} messages\n" in ok(d, "session", "show", sid)
    assert any(line.startswith(sid) and line.endswith(" chat") for line in ok(d, "session", "list").splitlines())
    engine.close_session(esid)
    # A role on a plain session: refused by the daemon.
    r = failed(d, 1, "append", new_session(d), "--text", "x", "--role", "assistant")
    assert "INVALID_ARGUMENT" in r.stderr and "role" in r.stderr


def test_append_from_a_file(d: RunningDaemon, engine: Engine, tmp_path: Path) -> None:
    path = tmp_path / "context.txt"
    path.write_text("Café, naïve, résumé: " + TEXT, encoding="utf-8")
    sid = new_session(d)
    summary = ok_json(d, "append", sid, "--file", str(path))
    expected = engine.tokenizer.encode(path.read_text(encoding="utf-8"))
    assert summary["tokens_added"] == len(expected) == summary["num_tokens"]
    shown = ok_json(d, "session", "show", sid, "--with-tokens")
    assert shown["token_ids"] == expected and shown["text"].endswith(TEXT)

    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café".encode("latin-1"))
    r = failed(d, 2, "append", sid, "--file", str(bad))
    assert "not UTF-8" in r.stderr and str(bad) in r.stderr
    r = failed(d, 2, "append", sid, "--file", str(tmp_path / "missing.txt"))
    assert "cannot read" in r.stderr
    assert ok_json(d, "session", "show", sid)["num_tokens"] == len(expected)  # nothing appended


def test_append_progress_on_stderr(d: RunningDaemon, tmp_path: Path) -> None:
    path = tmp_path / "long.txt"
    path.write_text(f"{tmp_path}\n" + LONG_TEXT * 4)  # a first block of its own: no prefix to reuse
    sid = new_session(d)
    r = d.ctl("append", sid, "--file", str(path))
    assert r.returncode == 0, r.stderr
    summary = re.fullmatch(r"appended (\d+) tokens in [0-9.]+ s \(the context holds \1 tokens\)\n", r.stdout)
    assert summary is not None, r.stdout
    total = int(summary[1])
    assert total > 2 * 32
    lines = r.stderr.splitlines()
    assert lines and lines[-1] == f"prefill: {total - 1}/{total - 1} tokens", r.stderr


def test_token_file_and_tcp(model: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("# clients\nclient-token\n")
    admins = tmp_path / "admins"
    admins.write_text("admin-token\n")
    extra = ["--auth-token-file", str(tokens), "--admin-token-file", str(admins)]
    with running_daemon(model, tmp_path / "data", extra=extra) as d:
        r = failed(d, 1, "session", "list")
        assert "UNAUTHENTICATED" in r.stderr and "--token-file" in r.stderr
        sid = ok_json(d, "--token-file", str(tokens), "session", "create")["session_id"]
        assert d.tcp_address is not None
        tcp = ctl_alone("--address", d.tcp_address, "--token-file", str(tokens), "--json", "session", "list")
        assert tcp.returncode == 0, tcp.stderr
        assert [s["session_id"] for s in json.loads(tcp.stdout)["sessions"]] == [sid]
        r = failed(d, 1, "--token-file", str(tokens), "config")
        assert "PERMISSION_DENIED" in r.stderr
        assert ok_json(d, "--token-file", str(admins), "config")["auth_token_file"] == str(tokens)
        # session show without GetConfig (a client token): the sums, said to be over the layers.
        shown = ok(d, "--token-file", str(tokens), "session", "show", sid[:6])
        assert "residency     HBM 0, DDR 0, SSD 0 block copies (all layers together; a block holds" in shown
        assert "kv_blocks" not in shown
        assert "PERMISSION_DENIED" in failed(d, 1, "--token-file", str(tokens), "resume").stderr


# ---- last: it drains the module's daemon (and resumes it) -------------------------------------------


def test_drain_then_resume(d: RunningDaemon) -> None:
    assert ok(d, "resume") == "the daemon was not draining: nothing to resume\n"
    drained = ok_json(d, "drain", "--timeout", "5")
    assert drained == {"requests_finished": 0, "requests_cancelled": 0}
    r = failed(d, 1, "session", "create")
    assert "UNAVAILABLE" in r.stderr and "draining" in r.stderr and "cannot reach" not in r.stderr
    r = failed(d, 1, "health")
    assert r.stdout == "NOT_SERVING\n"
    assert ok_json(d, "stats")["draining"] is True
    # Resume undoes it: serving again, new work taken.
    assert ok_json(d, "resume") == {"was_draining": True}
    assert ok(d, "health") == "SERVING\n"
    assert ok_json(d, "stats")["draining"] is False
    new_session(d)
    ok(d, "drain", "--timeout", "5")
    assert ok(d, "resume") == "resumed: the daemon was draining; it takes requests again\n"
    assert ok(d, "health") == "SERVING\n"
