"""The OpenAI-compatible HTTP API (`--http-listen`), through a real daemon (tests/live_daemon.py).

The clients are the official `openai` package (sync and async, streamed and not) and httpx for
the raw server-sent events and error statuses. Oracles: `h3d generate --chat` for a chat
completion's greedy text; the engine's prefill counter (GetStats) for what a continued response
prefilled; the stored responses' texts before and after a restart.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_daemon import RunningDaemon, running_daemon

from h3d._proto.h3.v1 import h3_pb2 as pb

MODEL = "llama_gqa4_tied"
HTTP = ["--http-listen", "127.0.0.1:0"]


@pytest.fixture(scope="module")
def model(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint(MODEL)


@pytest.fixture(scope="module")
def d(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    with running_daemon(model, tmp_path_factory.mktemp("h3d"), extra=HTTP, tcp=False) as daemon:
        yield daemon


def client(d: RunningDaemon, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=d.http_url, api_key=key, max_retries=0, timeout=60)


def stats(d: RunningDaemon) -> pb.Stats:
    return d.h3().GetStats(pb.GetStatsRequest())


def wait_for(pred: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def generate_chat_text(model: Path, prompt: str, n: int) -> str:
    cmd = [sys.executable, "-m", "h3d.cli", "generate", "--model", str(model), "--chat", "--prompt", prompt,
           "--max-tokens", str(n), "--json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
    return str(json.loads(out.strip().splitlines()[-1])["text"])


def sse_events(lines: Iterator[str]) -> list[tuple[str | None, str]]:
    """(event, data) of each server-sent event; the framing checked: fields, then a blank line."""
    out: list[tuple[str | None, str]] = []
    event: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            assert data, "an event without data"
            out.append((event, "\n".join(data)))
            event, data = None, []
        elif line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            data.append(line[len("data: ") :])
        else:
            raise AssertionError(f"not an SSE field: {line!r}")
    assert not data, "the stream ended inside an event"
    return out


# ---- what a user tries first ---------------------------------------------------------------


def test_models_lists_the_served_folder(d: RunningDaemon) -> None:
    models = client(d).models.list().data
    assert [m.id for m in models] == [MODEL]
    assert client(d).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(d).models.retrieve("gpt-4o")


def test_chat_completion_equals_h3d_generate_chat(d: RunningDaemon, model: Path) -> None:
    want = generate_chat_text(model, "Once upon a time", 12)
    c = client(d)
    whole = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=12, temperature=0
    )
    assert whole.choices[0].message.content == want and want
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 12
    assert whole.usage.prompt_tokens_details is not None and whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=12, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_a_chat_s_next_turn_reuses_the_last_one_s_kv(d: RunningDaemon) -> None:
    """Stateless turns: the second sends the whole conversation again and finds the first's KV
    (kept once it was answered), and `cached_tokens` says so; sent again, it finds its own and
    gives the same reply. (That a copied prefix decodes as a computed one is the engine's tests'.)"""
    c = client(d)
    story = "A river runs from the hills to the sea, and a town grows on each of its bends. " * 6
    history = [{"role": "user", "content": story + "Where does the river go?"}]
    first = c.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    history += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "And the town?"}]  # fmt: skip
    second = c.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % 32 == 0 and first.usage.prompt_tokens - 64 <= cached < second.usage.prompt_tokens - 64
    again = list(c.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0, stream=True,
                                           stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(ch.choices[0].delta.content or "" for ch in again if ch.choices) == second.choices[0].message.content
    assert again[-1].usage is not None and again[-1].usage.prompt_tokens_details is not None
    assert again[-1].usage.prompt_tokens_details.cached_tokens >= cached  # (the second turn's KV, now kept too)


def test_completions_take_text_or_token_ids(d: RunningDaemon) -> None:
    c = client(d)
    a = c.completions.create(model=MODEL, prompt="The cat sat", max_tokens=6, temperature=0)
    assert a.object == "text_completion" and a.usage is not None and a.usage.completion_tokens == 6
    streamed = list(c.completions.create(model=MODEL, prompt="The cat sat", max_tokens=6, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == a.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    ids = c.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=3)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]


def test_sampling_parameters_reach_the_sampler(d: RunningDaemon) -> None:
    c = client(d)

    def text(**kw: Any) -> str:
        out = c.completions.create(
            model=MODEL, prompt="The cat sat", max_tokens=24, extra_body={"ignore_eos": True}, **kw
        )
        return out.choices[0].text

    seeded = text(temperature=1.0, seed=7)
    assert seeded == text(temperature=1.0, seed=7)  # a seed is reproducible
    assert text(temperature=0) != text(temperature=0, frequency_penalty=2.0)  # the penalty changes greedy text
    stop = text(temperature=0)[4:7]
    if stop.strip():
        cut = c.completions.create(model=MODEL, prompt="The cat sat", max_tokens=24, stop=[stop], temperature=0)
        assert stop not in cut.choices[0].text and cut.choices[0].finish_reason == "stop"


def test_the_async_client_on_every_endpoint(d: RunningDaemon) -> None:
    async def run() -> None:
        c = openai.AsyncOpenAI(base_url=d.http_url, api_key="none", max_retries=0, timeout=60)
        chat = await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
        parts = [
            ch.choices[0].delta.content or ""
            async for ch in await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True
            )
        ]
        assert "".join(parts) == chat.choices[0].message.content
        done = await c.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        texts = [ch.choices[0].text async for ch in await c.completions.create(model=MODEL, prompt="Hi", max_tokens=4,
                                                                              stream=True)]  # fmt: skip
        assert "".join(texts) == done.choices[0].text
        r = await c.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
        kinds = [e.type async for e in await c.responses.create(model=MODEL, input="Hi", max_output_tokens=5,
                                                                stream=True)]  # fmt: skip
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        assert (await c.responses.retrieve(r.id)).output_text == r.output_text
        await c.close()

    asyncio.run(run())


# ---- the Responses API: stored responses are sessions --------------------------------------


def turn(c: openai.OpenAI, text: str, previous: str | None, n: int = 6) -> Any:
    kw: dict[str, Any] = {"previous_response_id": previous} if previous else {"instructions": "Be brief."}
    return c.responses.create(model=MODEL, input=text, max_output_tokens=n, temperature=0, **kw)


def prefilled(d: RunningDaemon) -> int:
    return stats(d).throughput.prefill_tokens_total


def test_a_chain_of_three_prefills_only_its_new_messages(d: RunningDaemon) -> None:
    c = client(d)
    before = prefilled(d)
    first = turn(c, "Tell me about the sea. " * 20, None)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert prefilled(d) - before == first.usage.input_tokens
    previous, history = first, first.usage.input_tokens + first.usage.output_tokens
    for question in ("And the sky?", "And the hills?"):
        before = prefilled(d)
        nxt = turn(c, question, previous.id)
        used = nxt.usage
        # Only the new message (with the template's markers) and the previous turn's last token
        # (its KV is made by the next request) are computed: counted by the engine.
        assert prefilled(d) - before == used.input_tokens - used.input_tokens_details.cached_tokens
        assert used.input_tokens_details.cached_tokens == history - 1
        assert used.input_tokens - history < 24
        assert nxt.previous_response_id == previous.id and nxt.output_text
        previous, history = nxt, used.input_tokens + used.output_tokens
    got = c.responses.retrieve(first.id)
    assert got.output_text == first.output_text and got.status == "incomplete"
    # An earlier response: the conversation is forked where it ended (its KV copied but for its
    # last tokens), and goes on as a conversation that stopped there does.
    before = prefilled(d)
    back = turn(c, "Back to the sea?", first.id)
    history = first.usage.input_tokens + first.usage.output_tokens
    assert back.previous_response_id == first.id
    assert back.usage.input_tokens_details.cached_tokens == (history - 1 - 64) // 32 * 32  # block_size 32
    assert prefilled(d) - before == back.usage.input_tokens - back.usage.input_tokens_details.cached_tokens
    alone = turn(c, "Tell me about the sea. " * 20, None)  # the same first turn, continued in place
    assert alone.output_text == first.output_text
    assert alone.usage.input_tokens_details.cached_tokens >= 32  # the first's KV found (share_prefixes)
    again = turn(c, "Back to the sea?", alone.id)
    assert (again.output_text, again.usage.input_tokens) == (back.output_text, back.usage.input_tokens)
    assert c.responses.retrieve(back.id).output_text == back.output_text
    assert turn(c, "And then?", back.id).previous_response_id == back.id  # the fork's latest: in place
    # store: false continues on the side: a fork of its own, deleted once answered.
    sessions = stats(d).throughput.sessions
    side = c.responses.create(model=MODEL, input="And the sky?", previous_response_id=previous.id, store=False,
                              max_output_tokens=4, temperature=0)  # fmt: skip
    assert side.output_text
    wait_for(lambda: stats(d).throughput.sessions == sessions, what="the side fork to go")
    assert turn(c, "And the sky?", previous.id, 4).output_text == side.output_text  # the original, in place


def test_streamed_responses_are_stored_like_whole_ones(d: RunningDaemon) -> None:
    c = client(d)
    events = list(c.responses.create(model=MODEL, input="Count to three.", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 6
    assert c.responses.retrieve(final.id).output_text == text
    nxt = c.responses.create(model=MODEL, input="Go on.", previous_response_id=final.id, max_output_tokens=3)
    assert nxt.usage.input_tokens_details.cached_tokens == final.usage.input_tokens + 6 - 1


def test_store_false_and_delete(d: RunningDaemon) -> None:
    c = client(d)
    sessions = stats(d).throughput.sessions
    eph = c.responses.create(model=MODEL, input="Hello", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(eph.id)
    wait_for(lambda: stats(d).throughput.sessions == sessions, what="the unstored response's session to go")
    kept = c.responses.create(model=MODEL, input="Hello", max_output_tokens=3)
    assert stats(d).throughput.sessions == sessions + 1  # a stored conversation is a session (gRPC lists it)
    nxt = c.responses.create(model=MODEL, input="Again", max_output_tokens=3, previous_response_id=kept.id)
    c.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(kept.id)
    assert c.responses.retrieve(nxt.id).output_text == nxt.output_text  # the chain's other response stays
    c.responses.delete(nxt.id)  # its last response: the session goes
    wait_for(lambda: stats(d).throughput.sessions == sessions, what="the deleted conversation's session to go")
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.create(model=MODEL, input="x", previous_response_id=nxt.id)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_a_chain_survives_a_restart(model: Path, tmp_path: Path) -> None:
    with running_daemon(model, tmp_path, extra=HTTP, tcp=False) as d:
        c = client(d)
        first = turn(c, "Tell me about rivers. " * 10, None)
        second = turn(c, "And lakes?", first.id)
        history = second.usage.input_tokens + second.usage.output_tokens
    with running_daemon(model, tmp_path, extra=HTTP, tcp=False) as d:
        assert d.events("responses_restored")[0]["responses"] == 2
        c = client(d)
        assert c.responses.retrieve(first.id).output_text == first.output_text
        assert c.responses.retrieve(second.id).output_text == second.output_text
        before = prefilled(d)
        third = turn(c, "And the sea?", second.id)
        used = third.usage
        assert used.input_tokens_details.cached_tokens == history - 1  # the KV came back from the archive
        assert prefilled(d) - before == used.input_tokens - used.input_tokens_details.cached_tokens
        back = turn(c, "Back?", first.id)  # a fork of the restored conversation
        assert back.output_text and c.responses.retrieve(back.id).output_text == back.output_text


def test_a_conversation_closed_for_idleness_goes_on(model: Path, tmp_path: Path) -> None:
    """`session_ttl_s` closes an idle conversation's session (its KV to the archive only); the next
    response reopens it, its history still not computed again."""
    with running_daemon(model, tmp_path, extra=[*HTTP, "--session-ttl-s", "0.5"], tcp=False) as d:
        c = client(d)
        first = turn(c, "Tell me about forests. " * 8, None)
        wait_for(lambda: d.events("session_expired"), what="the idle session to close")
        history = first.usage.input_tokens + first.usage.output_tokens
        nxt = turn(c, "And deserts?", first.id)
        assert nxt.usage.input_tokens_details.cached_tokens == history - 1
        assert c.responses.retrieve(first.id).output_text == first.output_text


# ---- the wire: SSE framing, errors, limits, auth, disconnects --------------------------------


def test_raw_sse_framing(d: RunningDaemon) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{d.http_url}/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{d.http_url}/responses", json=body, timeout=60) as r:
        events = sse_events(r.iter_lines())
    assert all(kind == json.loads(data)["type"] for kind, data in events)  # `event:` names each data's type
    assert "[DONE]" not in [data for _, data in events]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs",
         "unsupported_parameter"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n", "unsupported_parameter"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
         400, "response_format", "unsupported_parameter"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, "frobnicate",
         "unknown_parameter"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}, 400, "max_tokens",
         "invalid_value"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "invalid_value"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
         "messages[0].content", "invalid_value"),
        ({"model": MODEL}, 400, "messages", "missing_required_parameter"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, None, None),
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
    ],
)  # fmt: skip
def test_errors_are_openai_error_objects(
    d: RunningDaemon, body: dict[str, Any], status: int, param: str | None, code: str | None
) -> None:
    r = httpx.post(f"{d.http_url}/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param and (code is None or error["code"] == code)
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_malformed_bodies_routes_and_methods(d: RunningDaemon) -> None:
    url = d.http_url
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        r = httpx.post(f"{url}/chat/completions", content=raw, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/nothing", timeout=30).status_code == 404
    r = httpx.get(f"{url}/chat/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{url}/responses/resp_nope", timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_draining_answers_503(d: RunningDaemon) -> None:
    admin = d.admin()
    admin.Drain(pb.DrainRequest(timeout_s=1))
    try:
        r = httpx.post(f"{d.http_url}/completions", json={"model": MODEL, "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        assert httpx.get(d.http_url.removesuffix("/v1") + "/health", timeout=30).status_code == 503
    finally:
        admin.Resume(pb.ResumeRequest())
    assert httpx.get(d.http_url.removesuffix("/v1") + "/health", timeout=30).status_code == 200


def test_a_disconnect_cancels_the_generation(d: RunningDaemon) -> None:
    sessions = stats(d).throughput.sessions
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{d.http_url}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # three events: the generation is under way
        assert got[0].startswith("data: ")
    wait_for(lambda: any(e.get("method") == "Completions" and e.get("code") == 499 for e in d.events("rpc")),
             what="the cancelled request's rpc event")  # fmt: skip
    wait_for(lambda: stats(d).throughput.sessions == sessions, what="its session to go")
    made = stats(d).throughput.generated_tokens_total
    time.sleep(0.5)
    assert stats(d).throughput.generated_tokens_total == made  # nothing generates for nobody


def test_http_calls_are_counted_and_logged(d: RunningDaemon) -> None:
    client(d).completions.create(model=MODEL, prompt="x", max_tokens=2)
    events = [e for e in d.events("rpc") if e.get("api") == "http" and e.get("method") == "Completions"]
    assert events and {"request_id", "session_id", "code", "ms"} <= set(events[-1])
    assert any(e.get("api") == "grpc" for e in d.events("rpc"))


@pytest.fixture(scope="module")
def guarded(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """A daemon with tokens, one request at a time and small bodies."""
    root = tmp_path_factory.mktemp("guarded")
    tokens = root / "tokens"
    tokens.write_text("alice-token\nbob-token\n")
    extra = [*HTTP, "--auth-token-file", str(tokens), "--max-pending-requests", "1", "--max-message-bytes", "4096",
             "--retry-after-ms", "1500", "--metrics-listen", "127.0.0.1:0"]  # fmt: skip
    with running_daemon(model, root / "data", extra=extra, tcp=False) as daemon:
        yield daemon


def test_bearer_tokens_and_owners(guarded: RunningDaemon) -> None:
    url = guarded.http_url
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer mallory"}, {"Authorization": "Basic alice-token"}):
        r = httpx.post(f"{url}/responses", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["WWW-Authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        client(guarded, "mallory").models.list()
    alice, bob = client(guarded, "alice-token"), client(guarded, "bob-token")
    mine = alice.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert alice.responses.retrieve(mine.id).id == mine.id
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)  # another token's response does not exist for it
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model=MODEL, input="x", previous_response_id=mine.id)
    assert httpx.get(url.removesuffix("/v1") + "/health", timeout=30).status_code == 200  # no token needed


def test_limits_are_the_daemons(guarded: RunningDaemon) -> None:
    url, auth = guarded.http_url, {"Authorization": "Bearer alice-token"}
    big = {"model": MODEL, "prompt": "x" * 5000}
    r = httpx.post(f"{url}/completions", json=big, headers=auth, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True}
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with httpx.stream("POST", f"{url}/completions", json=body, headers=auth, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            held.set()
            release.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(30)
        r = httpx.post(f"{url}/completions", json={"model": MODEL, "prompt": "x"}, headers=auth, timeout=30)
        assert r.status_code == 429 and r.headers["Retry-After"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        release.set()
        t.join(30)
    metrics = wait_for(lambda: _metrics(guarded, 'api="http",method="Completions",code="429"'), what="the 429")
    assert 'h3d_rpc_duration_seconds_count{api="http",method="Completions"}' in metrics


def _metrics(d: RunningDaemon, needle: str) -> str | None:
    port = next(e["address"] for e in d.events("metrics_listening")).rsplit(":", 1)[1]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return text if needle in text else None


def test_tls_beyond_loopback(model: Path, tmp_path: Path) -> None:
    """Beyond loopback the API needs TLS (or tokens): served with the daemon's certificate."""
    import shutil

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=h3d",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)  # fmt: skip
    extra = ["--http-listen", "0.0.0.0:0", "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    with running_daemon(model, tmp_path / "data", extra=extra, tcp=False) as d:
        port = str(d.http_address).rsplit(":", 1)[1]
        url = f"https://127.0.0.1:{port}/v1"
        trust = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(verify=trust, timeout=30) as http:
            assert http.get(f"{url}/models").json()["data"][0]["id"] == MODEL
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10)  # no plaintext beside it
        tls = openai.OpenAI(base_url=url, api_key="x", http_client=httpx.Client(verify=trust), max_retries=0)
        assert tls.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
