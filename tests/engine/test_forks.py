"""Session forks through the Engine API: a fork's context is a prefix of its parent's, its KV
blocks shared where the parent holds them; it continues exactly as an unshared session given the same
tokens would, in every tier, and through a restart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import VOCAB_SIZE, make_engine, random_prompt

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId
from h3d.errors import InvalidRequest, SessionBusy, SessionNotFound
from h3d.hbf.policy import PROBE_QUERIES

GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
BS = 16


def _engine(checkpoint: Callable[[str], Path], tmp_path: Path, model: str, **kw: Any) -> Engine:
    return make_engine(
        checkpoint(model), prefill_chunk_tokens=64, ssd_path=str(tmp_path / "ssd"),
        session_log_path=str(tmp_path / "logs"), **kw,
    )  # fmt: skip


def _unshared(engine: Engine, tokens: list[int]) -> tuple[int, ...]:
    """The greedy continuation of a new session given `tokens` (then closed for good), of an
    owner of its own: its KV computed, not shared with a session with the same tokens."""
    sid = engine.create_session(owner="unshared")
    engine.append(sid, token_ids=tokens)
    out = engine.complete(sid, "", GREEDY).token_ids
    engine.close_session(sid, purge=True)
    return out


def _parent(engine: Engine, n: int = 300) -> SessionId:
    """A session of `n` prompt tokens that generated 16 more."""
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(n, VOCAB_SIZE, seed=5))
    engine.complete(sid, "", GREEDY)
    return sid


@pytest.mark.parametrize("model", ["llama_gqa4_tied", "qwen2_window_layers", "gemma3_window"])
def test_a_fork_continues_as_an_unshared_session_would(
    checkpoint: Callable[[str], Path], tmp_path: Path, model: str
) -> None:
    engine = _engine(checkpoint, tmp_path, model)
    parent = _parent(engine)
    tokens = list(engine.session(parent).tokens)
    for at in (None, 200, 3):
        fork = engine.fork_session(parent, at)
        n = len(tokens) if at is None else at
        assert engine.session(fork).tokens == tokens[:n]
        reused = engine.cached_tokens(fork)
        if at is None:  # the parent's twin: all its KV (its partial block copied), nothing to prefill
            assert reused == n - 1
        else:  # whole blocks shared, up to PROBE_QUERIES tokens before the last; window layers may refuse
            assert reused % BS == 0 and reused <= max(n - 1 - PROBE_QUERIES, 0)
        if model == "llama_gqa4_tied" and at is not None:  # (a window layer freed what a shorter fork would read)
            assert reused == max(n - 1 - PROBE_QUERIES, 0) // BS * BS
        rid = engine.catch_up(fork)
        if n > 1 + reused:
            assert rid is not None
            list(engine.run(rid))
        assert engine.cached_tokens(fork) == max(n - 1, 0) or n <= 1
        twin = engine.create_session(owner="twin")  # the same tokens computed: the same digests
        if n:
            engine.append(twin, token_ids=tokens[:n])
        full = engine.cached_tokens(fork) // BS
        kv = engine.kv
        if full and kv.digests.has(engine.session(fork).seq):
            got, want = (kv.digests.head(engine.session(s).seq, full) for s in (fork, twin))
            assert torch.allclose(got, want, atol=1e-5), f"digests of the fork at {at}"
        engine.close_session(twin, purge=True)
        assert engine.complete(fork, "", GREEDY).token_ids == _unshared(engine, tokens[:n]), f"fork at {at}"
    # The parent is as it was: its own continuation is an unshared session's too.
    assert engine.session(parent).tokens == tokens
    assert engine.complete(parent, "", GREEDY).token_ids == _unshared(engine, tokens)
    engine.close()


# bf16, and windows shorter than the context: each decode step selects
TWIN = dict(
    dtype="bf16", window_tokens=96, window_min_tokens=48, window_max_tokens=128, recent_tokens=32, dense_layers=1
)


def test_a_whole_fork_is_its_parents_twin(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A fork of the whole context computes nothing again: its KV is the parent's bit for bit (in
    bf16, where a tail prefilled again in a chunk of its own rounds differently from the parent's
    prompt), its HBF state is the parent's, and it continues as the parent does, before and after
    a restart; after it, a fork of the parent (its KV in the archive only) is its twin too."""
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied", **TWIN)
    parent = _parent(engine)
    fork = engine.fork(parent)
    kv = engine.kv
    a, b = (engine.session(s).seq for s in (parent, fork))
    assert kv.cached_tokens(b) == kv.cached_tokens(a) == len(engine.session(parent).tokens) - 1
    for layer in range(kv.blocks.num_layers):
        assert torch.equal(kv.tiers.read_keys(a, layer), kv.tiers.read_keys(b, layer)), f"layer {layer}"
    mine, theirs = kv.selection(b), kv.selection(a)
    assert (mine.window_tokens, mine.steps, len(mine.entropies)) == (
        theirs.window_tokens,
        theirs.steps,
        len(theirs.entropies),
    )
    assert mine.head_anchors.keys() == theirs.head_anchors.keys() and mine.head_anchors
    assert all(torch.equal(mine.head_anchors[k], theirs.head_anchors[k]) for k in mine.head_anchors)
    assert engine.complete(fork, "", GREEDY).token_ids == engine.complete(parent, "", GREEDY).token_ids
    twin = engine.fork(fork)  # (a twin of a twin, whose partial block is its own)
    engine.checkpoint()  # (as SIGTERM does: every block archived)
    engine.close()
    again = _engine(checkpoint, tmp_path, "llama_gqa4_tied", **TWIN)
    late = again.fork(parent)  # (its KV in the archive only: read back first, then shared)
    kv = again.kv
    a, b = (again.session(s).seq for s in (parent, late))
    assert kv.cached_tokens(b) == kv.cached_tokens(a)
    for layer in range(kv.blocks.num_layers):
        assert torch.equal(kv.tiers.read_keys(a, layer), kv.tiers.read_keys(b, layer)), f"layer {layer}"
    out = {s: again.complete(s, "", GREEDY).token_ids for s in (parent, fork, twin, late)}
    assert out[parent] == out[fork] == out[twin] == out[late]
    again.close()


def test_forks_share_their_parents_digests(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Forks read their whole blocks' digests where the parent's lie (`DigestStore.share`): four
    forks and a fork of a fork add rows only for their own blocks, their digests equal a session's
    that computed the same keys, and each continues as the parent would (every decode step
    selects: windows shorter than the context), also after the parent was cut below what they
    share and closed for good (they take copies first)."""
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied", **TWIN)
    parent = _parent(engine)
    kv, d = engine.kv, engine.kv.digests
    tokens = engine.session(parent).tokens
    a = engine.session(parent).seq
    before = d.nbytes()
    forks = [engine.fork(parent) for _ in range(4)]
    forks.append(engine.fork(forks[0]))
    full = (len(tokens) - 1) // BS
    for fork in forks:
        assert d.source(engine.session(fork).seq) == (d.base(a), full * d.parts)
    row = d.nbytes() // sum(d.layer(engine.session(s).seq, d.layers[0]).shape[1] for s in [parent, *forks])
    assert d.nbytes() - before <= 5 * row * 2 * d.parts  # a partial block's rows each (with slack), not a copy
    assert d.shared_parts() == 5 * full * d.parts
    for fork in (parent, forks[0], forks[4]):  # each part's min and max of the fork's own keys
        seq = engine.session(fork).seq
        got = d.head(seq, full + 1)
        for layer in d.layers:
            k = kv.tiers.read_keys(seq, layer)  # [Hkv, n, D]
            for j in range(0, k.shape[1], d.part_tokens):
                part = k[:, j : j + d.part_tokens]
                lo, hi = got[d.index(layer), :, j // d.part_tokens].unbind(1)  # [Hkv, D] each
                assert torch.equal(lo, part.amin(dim=1)) and torch.equal(hi, part.amax(dim=1)), (fork, layer, j)
    want = engine.complete(parent, "", GREEDY).token_ids
    assert engine.complete(forks[0], "", GREEDY).token_ids == want
    engine.rewind(parent, 40)  # below what the forks share: they take their own copies first
    assert d.source(engine.session(forks[1]).seq) == (0, 0)
    assert engine.complete(forks[1], "", GREEDY).token_ids == want
    engine.close_session(parent, purge=True)
    for fork in forks[2:]:
        assert engine.complete(fork, "", GREEDY).token_ids == want, f"fork {fork}"
    assert d.shared_parts() == 0
    engine.close()


@pytest.mark.parametrize("tier", ["ddr", "ssd", "ssd, DDR short"])
def test_a_fork_of_a_parent_below_hbm(checkpoint: Callable[[str], Path], tmp_path: Path, tier: str) -> None:
    """A parent's blocks in DDR are shared where they are; blocks in the archive only are read back
    into DDR first (below the high watermark): all of them for a twin; where DDR cannot take them
    all, the fork shares those it could, a prefix, and prefills the rest. The tokens are the same
    either way."""
    short = tier == "ssd, DDR short"
    slots = 3 * 12  # (DDR for 12 blocks a layer: below the high watermark, 9 of the parent's 19)
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied", **({"ddr_mb": slots * 4096 / 2**20} if short else {}))
    parent = _parent(engine)
    tokens = list(engine.session(parent).tokens)
    assert engine.kv.demote(engine.session(parent).seq, to_ssd=tier != "ddr") > 0
    fork = engine.fork(parent)
    notice = [d for kind, d in engine.kv.take_notices() if kind == "session_forked"][-1]
    assert notice["parent"] == parent and notice["tokens"] == len(tokens)
    full = (len(tokens) - 1) // BS
    if not short:  # the parent's twin: every block shared where it is (read back first), the partial one copied
        assert notice["kv_shared_tokens"] == len(tokens) - 1
        if tier == "ssd":
            assert engine.tier_stats().ssd_read_count >= 3 * full  # 3 layers
    else:
        assert 0 < notice["kv_shared_tokens"] < (len(tokens) - 1 - PROBE_QUERIES) // BS * BS
    assert engine.complete(fork, "", GREEDY).token_ids == _unshared(engine, tokens)
    engine.close()


def test_a_fork_of_a_closed_session_leaves_it_in_the_archive_but_what_it_shares(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A closed parent's blocks are read back into DDR for its fork; those the fork shares stay
    there while it does (for both), the others go back to the archive only."""
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied")
    parent = _parent(engine)
    tokens = list(engine.session(parent).tokens)
    engine.close_session(parent)
    seq = engine.session(parent).seq
    assert engine.kv.residency(seq).hbm == engine.kv.residency(seq).ddr == 0
    fork = engine.fork(parent)
    assert engine.cached_tokens(fork) == len(tokens) - 1
    shared = (len(tokens) - 1) // BS  # (its twin: every full block)
    kept = engine.kv.residency(seq)  # (the fork's steps may have promoted shared blocks to HBM)
    assert kept.ddr == 3 * shared and kept.hbm <= 3 * shared  # 3 layers
    assert engine.session(parent).closed
    assert engine.complete(fork, "", GREEDY).token_ids == _unshared(engine, tokens)
    engine.close_session(fork, purge=True)
    assert engine.complete(parent, "", GREEDY).token_ids == _unshared(engine, tokens)
    engine.close()


def test_forks_survive_a_restart(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied")
    parent = _parent(engine)
    fork = engine.fork(parent, 250)
    want = list(engine.session(fork).tokens)
    engine.close()
    again = _engine(checkpoint, tmp_path, "llama_gqa4_tied")
    assert again.session(fork).tokens == want
    assert len(again.session(parent).tokens) == 316
    assert again.complete(fork, "", GREEDY).token_ids == _unshared(again, want)
    again.close()


def test_a_chat_fork_keeps_its_conversation(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied")
    chat = engine.create_session(system_prompt="Be brief.", chat=True)
    engine.append(chat, text="What is a block?", role="user")
    engine.complete(chat, "", GREEDY)
    after_reply = len(engine.session(chat).tokens)
    engine.append(chat, text="And a tier?", role="user")
    whole = engine.fork(chat)
    assert engine.session(whole).chat == engine.session(chat).chat
    # At the end of the first reply: the conversation as it stood then, its turn still open.
    early = engine.fork(chat, after_reply)
    messages = engine.session(early).chat
    assert messages is not None and [m["role"] for m in messages.messages] == ["system", "user"]
    assert messages.open_at is not None
    assert engine.complete(whole, "", GREEDY).token_ids == engine.complete(chat, "", GREEDY).token_ids
    engine.append(early, text="Thanks.", role="user")
    a = engine.complete(early, "", GREEDY)
    fresh = engine.create_session(system_prompt="Be brief.", chat=True)
    engine.append(fresh, text="What is a block?", role="user")
    first = engine.complete(fresh, "", GREEDY)
    assert engine.session(fresh).tokens == engine.session(chat).tokens[: len(engine.session(fresh).tokens)]
    assert first.token_ids  # (the parent's first reply, made again)
    engine.append(fresh, text="Thanks.", role="user")
    assert engine.complete(fresh, "", GREEDY).token_ids == a.token_ids
    # Inside a message's tokens: refused, nothing made.
    before = set(engine.sessions)
    with pytest.raises(InvalidRequest, match="inside a chat message"):
        engine.fork_session(chat, after_reply + 2)
    assert set(engine.sessions) == before and len(engine.journal.open_sessions()) == len(before)  # type: ignore[union-attr]
    engine.close()


def test_fork_refusals(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied")
    parent = _parent(engine, 40)
    with pytest.raises(InvalidRequest, match="at_tokens: 57 is past"):
        engine.fork_session(parent, 57)
    with pytest.raises(SessionNotFound):
        engine.fork_session(SessionId("0" * 32))
    engine.submit(parent, generate=True, params=GREEDY)
    with pytest.raises(SessionBusy):
        engine.fork_session(parent)
    engine.close()


@pytest.mark.parametrize("seed", [7, 8])
def test_random_forks_reuse_and_evictions_keep_every_session_exact(
    checkpoint: Callable[[str], Path], tmp_path: Path, seed: int
) -> None:
    """Random sessions, forks, prefix hits, retirements, evictions down the tiers, rewinds and
    closes, the invariants checked at every step (`check_invariants`): every live session then
    continues exactly as a new session given its tokens does."""
    import random

    rng = random.Random(seed)
    engine = _engine(checkpoint, tmp_path, "llama_gqa4_tied", hbm_mb=0.25, prefix_cache_sessions=2)
    docs = [random_prompt(rng.randrange(80, 260), VOCAB_SIZE, seed=s) for s in range(3)]
    live: list[SessionId] = []
    for _ in range(60):
        op = rng.choice(["new", "new", "fork", "fork", "grow", "grow", "retire", "evict", "evict", "rewind", "close"])
        if op == "new" or not live:
            sid = engine.create_session()
            tokens = list(rng.choice(docs)) + random_prompt(rng.randrange(0, 40), VOCAB_SIZE, seed=rng.randrange(99))
            engine.append(sid, token_ids=tokens)
            live.append(sid)
            continue
        sid = rng.choice(live)
        if op == "fork":
            at = rng.choice([None, rng.randrange(0, len(engine.session(sid).tokens) + 1)])
            live.append(engine.fork(sid, at))
        elif op == "grow":
            engine.complete(sid, "", SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True))
        elif op == "retire":
            engine.retire(sid)
            live.remove(sid)
        elif op == "evict":
            engine.kv.demote(engine.session(sid).seq, to_ssd=rng.random() < 0.5)
        elif op == "rewind":
            engine.rewind(sid, rng.randrange(0, len(engine.session(sid).tokens) + 1))
        else:
            engine.close_session(sid, purge=rng.random() < 0.5)
            if sid not in engine.sessions:
                live.remove(sid)
    assert engine.counters.prefix_hits > 0  # (the sequence exercised reuse)
    short = SamplingParams(max_tokens=6, ignore_eos=True)
    for sid in live:
        tokens = list(engine.session(sid).tokens)
        if not tokens:
            continue
        got = engine.complete(sid, "", short).token_ids
        ref = engine.create_session(owner="reference")  # another owner: computed, not shared
        engine.append(ref, token_ids=tokens)
        assert got == engine.complete(ref, "", short).token_ids, f"session {sid}"
        engine.close_session(ref, purge=True)
    assert engine.tier_stats().ssd_read_count > 0  # (and sessions read back from the archive)
    engine.close()
