"""Prefix reuse (`share_prefixes`): a new session whose tokens begin with whole blocks another
session holds KV for shares those KV blocks at its first request; it decodes exactly as it would have
computing it, owners stay apart, and finished request sessions (`Engine.retire`) serve as a prefix
cache, least recently used dropped first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import TEST_DEVICE, VOCAB_SIZE, make_engine, random_prompt

from h3d.engine.engine import Engine
from h3d.engine.prefixes import PrefixIndex
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId
from h3d.hbf.policy import PROBE_QUERIES

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
BS = 16
MODEL = "llama_gqa4_tied"
DOC = random_prompt(300, VOCAB_SIZE, seed=11)
QUESTION = random_prompt(100, VOCAB_SIZE, seed=12)


def _engine(checkpoint: Callable[[str], Path], tmp_path: Path, **kw: Any) -> Engine:
    return make_engine(checkpoint(MODEL), prefill_chunk_tokens=64, session_log_path=str(tmp_path / "logs"), **kw)


def _ask(engine: Engine, tokens: list[int], owner: str = "x") -> tuple[SessionId, int, tuple[int, ...]]:
    """A new session of `owner` given `tokens`: (its id, the KV it started with, its greedy continuation)."""
    sid = engine.create_session(owner=owner)
    rid = engine.submit(sid, token_ids=tokens, generate=False)
    reused = engine.cached_tokens(sid)
    list(engine.run(rid))
    return sid, reused, engine.complete(sid, "", GREEDY).token_ids


def test_the_index_finds_the_longest_shared_blocks() -> None:
    index = PrefixIndex(4)
    index.refresh("a", "s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    index.refresh("b", "s", [1, 2, 3, 4, 5, 6, 7, 0])
    index.refresh("c", "t", [1, 2, 3, 4, 5, 6, 7, 8])  # another scope
    assert index.longest("s", [1, 2, 3, 4, 5, 6, 7, 8, 1, 1, 1, 1]) == {"a": 2}
    assert index.longest("s", [1, 2, 3, 4, 9, 9, 9, 9]) == {"a": 1, "b": 1}
    assert index.longest("s", [1, 2, 3, 4], exclude="a") == {"b": 1}
    assert index.longest("s", [2, 2, 3, 4]) == {} and index.longest("u", [1, 2, 3, 4]) == {}
    index.refresh("a", "s", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])  # grown: only its new block hashed
    assert index.longest("s", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == {"a": 3}
    index.forget("a")
    assert index.longest("s", [1, 2, 3, 4, 5, 6, 7, 8]) == {"b": 1} and len(index) == 2


def test_a_new_session_reuses_a_prefix_and_decodes_as_without(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    on = _engine(checkpoint, tmp_path / "on")
    off = _engine(checkpoint, tmp_path / "off", share_prefixes="off")
    for engine in (on, off):
        _ask(engine, DOC)
    _, reused, got = _ask(on, DOC + QUESTION)
    assert reused == len(DOC) // BS * BS  # its whole blocks of the document (the next one differs)
    assert on.counters.prefix_hits == 1 and on.counters.prefix_reused_tokens == reused
    assert on.counters.prefix_queries == 2  # (the document's own first request found nothing)
    _, none, want = _ask(off, DOC + QUESTION)
    assert none == 0 and off.counters.prefix_queries == 0
    assert got == want
    # Another owner's prompt is no hit; with `all` it is.
    _, other, theirs = _ask(on, DOC + QUESTION, owner="y")
    assert other == 0 and theirs == want and on.counters.prefix_hits == 1
    shared = _engine(checkpoint, tmp_path / "all", share_prefixes="all")
    _ask(shared, DOC, owner="x")
    assert _ask(shared, DOC + QUESTION, owner="y")[1] == len(DOC) // BS * BS
    # The same tokens again: everything but the last PROBE_QUERIES + 1 is copied.
    assert _ask(on, DOC + QUESTION)[1] == (len(DOC + QUESTION) - 1 - PROBE_QUERIES) // BS * BS
    for engine in (on, off, shared):
        engine.close()


def test_retired_sessions_are_a_prefix_cache(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    engine = _engine(checkpoint, tmp_path, prefix_cache_sessions=1)
    first, _, _ = _ask(engine, DOC)
    engine.retire(first)
    assert first not in engine.sessions and list(engine.prefix_cache) == [first]
    assert not (tmp_path / "logs" / f"{first}.h3log").exists()  # deleted as a purge deletes it
    turn2 = DOC + QUESTION
    second, reused, got = _ask(engine, turn2)
    assert reused == len(DOC) // BS * BS
    off = _engine(checkpoint, tmp_path / "off", share_prefixes="off")
    assert got == _ask(off, turn2)[2]
    off.close()
    seq = engine.prefix_cache[first].seq
    engine.retire(second)  # one kept: the least recently used goes, its KV with it
    assert list(engine.prefix_cache) == [second] and not engine.kv.has(seq)
    assert _ask(engine, turn2)[1] == (len(turn2) - 1 - PROBE_QUERIES) // BS * BS  # from the second
    none = _engine(checkpoint, tmp_path / "none", prefix_cache_sessions=0)
    sid, _, _ = _ask(none, DOC)
    none.retire(sid)
    assert not none.prefix_cache and sid not in none.sessions
    none.close()
    engine.close()


@pytest.mark.parametrize("ddr_mb", [16.0, 0.03])
def test_a_donor_in_the_archive_only(checkpoint: Callable[[str], Path], tmp_path: Path, ddr_mb: float) -> None:
    """Its blocks are read back into DDR first, as many as fit below the high watermark; the
    copy ends at the first one left in the archive (with little DDR: none), the rest computed."""
    engine = _engine(checkpoint, tmp_path, ssd_path=str(tmp_path / "ssd"), ddr_mb=ddr_mb)
    donor, _, _ = _ask(engine, DOC)
    engine.kv.demote(engine.session(donor).seq, to_ssd=True)
    _, reused, got = _ask(engine, DOC + QUESTION)
    assert reused == (len(DOC) // BS * BS if ddr_mb > 1 else 0) and engine.counters.prefix_queries == 2
    off = _engine(checkpoint, tmp_path / "off", share_prefixes="off")
    assert got == _ask(off, DOC + QUESTION)[2]
    off.close()
    engine.close()


def test_a_chat_after_its_short_system_message_reuses_a_prefix(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A conversation's messages go in one by one: its system message leaves less than a block
    of KV, dropped when its next message finds a longer prefix elsewhere."""
    bs = 32  # (the daemon's default: a system message's template takes less)
    engine = _engine(checkpoint, tmp_path, block_size=bs)
    off = _engine(checkpoint, tmp_path / "off", share_prefixes="off", block_size=bs)
    text = "a long shared document about tiers and blocks, " * 30
    outs = []
    for e in (engine, engine, off):
        sid = e.create_session(chat=True, owner="x")
        e.append(sid, text="Be brief.", role="system")
        assert 0 < e.cached_tokens(sid) < bs
        rid = e.submit(sid, text=text, role="user", generate=False)
        outs.append(e.cached_tokens(sid))
        list(e.run(rid))
        outs.append(e.complete(sid, "", GREEDY).token_ids)
    first_reused, first, second_reused, second, off_reused, unshared = outs
    assert first_reused < bs and off_reused < bs  # nothing to reuse: the system message's KV kept
    assert second_reused >= bs * 5 and second_reused % bs == 0
    assert second == first == unshared
    engine.close()
    off.close()


def test_the_embedded_model_s_conversation_reused_and_forked(smol_dir: Path, tmp_path: Path) -> None:
    """A three-turn chat on the embedded model, as the OpenAI API runs it: each turn a new session
    given the whole conversation rendered through the template, retired once answered, so that
    the next turn copies its KV; then a stateful chat forked after its second turn. Every reply
    is the one an engine computing every token gives (`share_prefixes` off)."""
    from h3d.config import EngineConfig
    from h3d.engine.chat import render

    small = {"hbm_mb": 256.0, "ddr_mb": 256.0}
    on = Engine(EngineConfig.build(model=str(smol_dir), session_log_path=str(tmp_path / "on"), **small))
    off = Engine(
        EngineConfig.build(model=str(smol_dir), session_log_path=str(tmp_path / "off"), share_prefixes="off", **small)
    )
    doc = "h3d keeps each session's KV cache in three tiers: HBM for the active window, DDR as a standby "
    doc = (doc + "buffer, and an SSD archive, compressed and checksummed, for the cold blocks. ") * 8
    questions = ["What are the three tiers?", "Which tier is the slowest?", "Why is it used at all?"]

    def params(engine: Engine) -> SamplingParams:
        return SamplingParams(max_tokens=24, stop_token_ids=(engine.end_of_turn or 0,))

    def stateless(engine: Engine, messages: list[dict[str, str]]) -> tuple[str, int]:
        sid = engine.create_session()
        before = engine.counters.prefix_reused_tokens
        done = engine.complete(sid, render(engine.tokenizer, messages, generation=True), params(engine))
        engine.retire(sid)
        return done.text, engine.counters.prefix_reused_tokens - before

    messages: list[dict[str, str]] = [{"role": "system", "content": "Answer in one sentence."}]
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": (doc if i == 0 else "") + question})
        (got, reused), (want, none) = stateless(on, messages), stateless(off, messages)
        assert got == want and none == 0
        assert (reused > 0) == (i > 0), f"turn {i + 1} reused {reused} tokens"
        messages.append({"role": "assistant", "content": got})
    replies = []
    for engine in (on, off):
        sid = engine.create_session(system_prompt="Answer in one sentence.", chat=True)
        for question in questions[:2]:
            engine.complete(sid, (doc if question == questions[0] else "") + question, params(engine))
        target = engine.fork(sid) if engine is on else sid  # the fork, against the session itself
        replies.append(engine.complete(target, questions[2], params(engine)).token_ids)
    assert replies[0] == replies[1]
    on.close()
    off.close()


def test_the_prefix_cache_leaves_nothing_in_the_archive(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Its sessions keep no token log: their archived blocks go when the engine closes, and a
    start with token logs deletes any left by a daemon that was killed."""
    kw: dict[str, Any] = {"ssd_path": str(tmp_path / "ssd")}
    engine = _engine(checkpoint, tmp_path, **kw)
    kept, _, _ = _ask(engine, DOC)
    engine.kv.snapshot(engine.session(kept).seq)  # archived, as write-behind does
    retired, _, _ = _ask(engine, DOC + QUESTION)
    engine.kv.snapshot(engine.session(retired).seq)
    engine.retire(retired)
    archive = engine.kv.archive
    assert archive is not None and archive.sessions() == {kept, retired}
    engine.close()
    again = _engine(checkpoint, tmp_path, **kw)
    assert again.kv.archive is not None and again.kv.archive.sessions() == {kept} and again.swept == 0
    again.close()
    # A killed daemon's leftover: a retired session's records, no log.
    killed = _engine(checkpoint, tmp_path, **kw)
    orphan, _, _ = _ask(killed, DOC + QUESTION)
    killed.kv.snapshot(killed.session(orphan).seq)
    killed.retire(orphan)
    killed.prefix_cache.clear()  # (as if it died here: nothing dropped)
    killed.close()
    last = _engine(checkpoint, tmp_path, **kw)
    assert last.swept > 0 and last.kv.archive is not None and last.kv.archive.sessions() == {kept}
    assert last.complete(kept, "", GREEDY).token_ids  # the logged session's KV is kept
    last.close()


def test_a_start_and_its_first_requests_import_no_dynamo(checkpoint: Callable[[str], Path]) -> None:
    """torch._dynamo costs seconds to import: neither the start nor a prompt, a prefix reused
    (a chunk over cached blocks) or a fork may bring it in (the first prefill over a cached prefix
    once did, through torch's lower-right causal bias: 3.3 s of a chat's second turn on an H100)."""
    import subprocess
    import sys

    # On a GPU test run, the card's path in bf16 (flash attention's lower-right mask).
    on_device = {"device": TEST_DEVICE, "dtype": "bf16"} if TEST_DEVICE and TEST_DEVICE.startswith("cuda") else {}
    code = (
        "import sys\n"
        "from h3d.config import EngineConfig\n"
        "from h3d.engine.engine import Engine\n"
        "from h3d.engine.sampling import SamplingParams\n"
        f"e = Engine(EngineConfig.build(model={str(checkpoint(MODEL))!r}, hbm_mb=8.0, ddr_mb=16.0, block_size=16,\n"
        f"                               prefill_chunk_tokens=64, **{on_device!r}))\n"
        "assert 'torch._dynamo' not in sys.modules, 'the start imported torch._dynamo'\n"
        f"doc, p = {DOC!r}, SamplingParams(max_tokens=4, ignore_eos=True)\n"
        "a = e.create_session(); e.append(a, token_ids=doc); e.complete(a, '', p)\n"
        "b = e.create_session(); e.append(b, token_ids=doc + [7, 8, 9]); e.complete(b, '', p)\n"
        "assert e.counters.prefix_hits == 1, 'no prefix reused'\n"
        "f = e.fork(a); e.complete(f, '', p)\n"
        "assert 'torch._dynamo' not in sys.modules, 'a request imported torch._dynamo'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
