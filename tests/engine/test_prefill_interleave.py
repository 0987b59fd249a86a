"""A long prompt runs in pieces beside decoding streams (h3d.engine.prefill).

The bound is counted on a fake clock (each piece of the long forward "takes" 10 ms): with
`prefill_step_ms` = 35 a step runs at most 3 pieces, and a decoding stream gets a token at every
step while the long prompt is in flight. What the pieces compute is checked three ways: the
decoding stream's tokens equal its tokens alone; the long prompt's session continues with the
tokens it gets when appended alone and in one go (the same arithmetic, so equal); and its KV,
read by teacher-forced steps, gives the logits of the plain path (one forward, no slices) within
1e-4. Cancelling or closing midway leaves the session's KV where the chunk started, its tokens in
its log; with small HBM and DDR and an archive, the steps between the pieces demote and spill
other sessions' blocks but never the long prompt's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import make_engine, random_prompt

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import AppendDone, FinishReason, GenerationDone, PrefillProgress, TokenDelta
from h3d.engine.step import Chunk

MODEL = "llama_long"  # 8 query heads over 2 KV heads, 3 layers, 8,192 positions
LONG = 600  # tokens of the long prompt (one chunk: > ROWS)
ROWS = 32  # tokens per slice: a chunk of more is long
PIECE_S = 0.010  # what each piece "takes" on the fake clock
STEP_MS = 35.0  # -> at most 3 pieces a step


def _engine(path: Path, **overrides: Any) -> Engine:
    kw: dict[str, Any] = {
        "max_context_tokens": 2048,
        "prefill_chunk_tokens": 2048,
        "prefill_step_ms": STEP_MS,
        "policy": "exact",
    }
    kw.update(overrides)
    engine = make_engine(path, **kw)
    engine.model.rows = ROWS
    engine.model.unit_bytes = 1  # one KV head's attention per piece
    inter = engine.interleave
    inter.clock = lambda: inter.pieces_total * PIECE_S
    return engine


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _decoder(engine: Engine, vocab: int) -> tuple[Any, int]:
    """A session that decodes 40 tokens after a 20-token prompt; (session id, request id)."""
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(20, vocab, seed=1))
    return sid, engine.submit(sid, generate=True, params=_params(40))


def _tokens(events: list[Any], rid: int) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenDelta) and e.request_id == rid]


def _decoded_alone(path: Path, vocab: int) -> list[int]:
    """The tokens `_decoder`'s session decodes on an engine with nothing else to do."""
    alone = _engine(path)
    _, rid = _decoder(alone, vocab)
    out: list[int] = []
    while rid in alone.requests():
        out += _tokens(alone.step(), rid)
    return out


def test_a_decoding_stream_gets_a_token_every_step_beside_a_long_prompt(checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint(MODEL)
    engine = _engine(path, prefill_chunk_tokens=LONG - 1)  # the batch's decode token leaves it one short
    vocab = engine.model.config.vocab_size
    _a, ra = _decoder(engine, vocab)
    got = _tokens(engine.step() + engine.step(), ra)  # decoding before the long prompt arrives
    b = engine.create_session()
    rb = engine.submit(b, token_ids=random_prompt(LONG, vocab, seed=2), generate=False)
    steps, done = 0, None
    while done is None:
        before = engine.interleave.pieces_total
        events = engine.step()
        steps += 1
        pieces = engine.interleave.pieces_total - before
        mine = _tokens(events, ra)
        done = next((e for e in events if isinstance(e, AppendDone) and e.request_id == rb), None)
        assert pieces <= 3, f"step {steps} ran {pieces} pieces of the long prompt (budget {STEP_MS} ms)"
        assert done is None or pieces > 0  # it ends with its last piece: one chunk, no tail left over
        assert len(mine) == 1, f"step {steps}: the decoding stream got {len(mine)} tokens"
        progress = [e for e in events if isinstance(e, PrefillProgress) and e.request_id == rb]
        if done is None:
            assert progress and 0 <= progress[-1].done < LONG - 1 and progress[-1].total == LONG - 1
        got += mine
    pieces = engine.interleave.pieces_total
    # Per layer: the projections, 2 KV heads' attention, the MLP's slices; then the final norm.
    assert pieces == 3 * (1 + 2 + -(-(LONG - 1) // ROWS)) + 1
    assert steps == -(-pieces // 3) and engine.interleave.pauses == steps - 1
    assert engine.cached_tokens(b) == LONG - 1 and not engine.kv.frozen
    while ra in engine.requests():
        got += _tokens(engine.step(), ra)

    assert got == _decoded_alone(path, vocab) and len(got) == 40

    # The long prompt's session continues as when it is appended alone in one go.
    def continuation(engine: Engine, sid: Any) -> list[int]:
        return [e.token_id for e in engine.generate(sid, params=_params(12)) if isinstance(e, TokenDelta)]

    one_go = _engine(path, prefill_step_ms=1e9)
    b2 = one_go.create_session()
    one_go.append(b2, token_ids=random_prompt(LONG, vocab, seed=2))
    assert one_go.interleave.pauses == 0
    assert continuation(engine, b) == continuation(one_go, b2)


def test_on_a_gpu_the_host_stays_one_piece_ahead_and_the_budget_counts_it(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where pieces are queued (a GPU: `ModelRunner.mark` gives an event), the host queues a
    piece, then waits for the one before it, so the device has the next piece as soon as it ends
    one; the piece still in flight when a step stops counts against the budget. On the fake
    clock (10 ms a piece, 35 ms a step): 2 pieces a step instead of 3, each step's first piece
    waited for by its second, and the decoding stream's tokens as without the lookahead."""
    path = checkpoint(MODEL)
    engine = _engine(path)
    waits: list[int] = []

    class Queued:
        def __init__(self, piece: int) -> None:
            self.piece = piece

        def synchronize(self) -> None:
            waits.append(self.piece)

    monkeypatch.setattr(engine.runner, "mark", lambda: Queued(engine.interleave.pieces_total))
    vocab = engine.model.config.vocab_size
    _a, ra = _decoder(engine, vocab)
    got = _tokens(engine.step(), ra)
    b = engine.create_session()
    rb = engine.submit(b, token_ids=random_prompt(LONG, vocab, seed=2), generate=False)
    steps, done = 0, False
    while not done:
        before = engine.interleave.pieces_total
        events = engine.step()
        steps += 1
        pieces = engine.interleave.pieces_total - before
        assert 1 <= pieces <= 2, f"step {steps} ran {pieces} pieces"
        if pieces == 2:
            assert waits[-1] == before + 1  # its first piece, waited for once the second was queued
        got += _tokens(events, ra)
        done = any(isinstance(e, AppendDone) and e.request_id == rb for e in events)
    assert steps == -(-engine.interleave.pieces_total // 2)
    while ra in engine.requests():
        got += _tokens(engine.step(), ra)
    assert got == _decoded_alone(path, vocab) and len(got) == 40


def test_the_pieces_write_the_kv_of_the_plain_path(checkpoint: Callable[[str], Path]) -> None:
    """Teacher-forced logits of 8 tokens after the long prompt, read from the KV its pieces wrote
    (beside a decoding stream), against the plain path's (one forward per 512-token chunk, no slices)."""
    path = checkpoint(MODEL)
    vocab = 0
    logits = []
    for pieces in (True, False):
        engine = _engine(path)
        vocab = engine.model.config.vocab_size
        ids = random_prompt(LONG + 8, vocab, seed=3)
        if not pieces:
            engine.model.rows = None
        _, ra = _decoder(engine, vocab)
        sid = engine.create_session()
        engine.submit(sid, token_ids=ids[:LONG], generate=False)
        while engine.cached_tokens(sid) < LONG - 1 or sid in {r.session.id for r in engine.requests().values()}:
            engine.step()
        assert (engine.interleave.pauses > 0) == pieces
        seq = engine.session(sid).seq
        chunk = Chunk(seq, tuple(ids[LONG - 1 :]), LONG - 1, True)
        logits.append(engine.runner.step([chunk], all_logits=True))
        engine.cancel(ra)
    delta = (logits[0] - logits[1]).abs().max().item()
    assert delta <= 1e-4, f"max |Δ logits| = {delta:.3g}"
    assert logits[1].std().item() > 0.5


@pytest.mark.parametrize("how", ["cancel", "close"])
def test_a_long_prompt_dropped_midway_leaves_its_kv_where_it_started(
    how: str, checkpoint: Callable[[str], Path]
) -> None:
    engine = _engine(checkpoint(MODEL))
    vocab = engine.model.config.vocab_size
    _, ra = _decoder(engine, vocab)
    b = engine.create_session()
    engine.append(b, token_ids=random_prompt(20, vocab, seed=4))  # short: the plain path
    cached = engine.cached_tokens(b)
    rb = engine.submit(b, token_ids=random_prompt(LONG, vocab, seed=5), generate=True, params=_params(3))
    engine.step()
    engine.step()
    assert engine.interleave.current is not None and engine.kv.frozen
    if how == "cancel":
        engine.cancel(rb)
        events = engine.step()
        ended = [e for e in events if isinstance(e, GenerationDone) and e.request_id == rb]
        assert ended and ended[0].finish_reason is FinishReason.CANCELLED
    else:
        engine.close_session(b)
        assert any(isinstance(e, GenerationDone) and e.request_id == rb for e in engine.take_events())
    assert engine.interleave.current is None and not engine.kv.frozen
    assert len(engine.session(b).tokens) == 20 + LONG  # the log keeps them
    if how == "cancel":
        assert engine.cached_tokens(b) == cached
    # The next request computes the rest and decodes as a session that was never interrupted.
    out = [e.token_id for e in engine.generate(b, params=_params(6)) if isinstance(e, TokenDelta)]
    fresh = _engine(checkpoint(MODEL))
    c = fresh.create_session()
    fresh.append(c, token_ids=random_prompt(20, vocab, seed=4) + random_prompt(LONG, vocab, seed=5))
    want = [e.token_id for e in fresh.generate(c, params=_params(6)) if isinstance(e, TokenDelta)]
    assert out == want
    assert ra in engine.requests()  # the decoding stream went on


def test_steps_between_the_pieces_never_move_the_long_prompts_blocks(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """HBM of 8 blocks per layer and DDR of 60: the decoding sessions' steps demote, spill and
    stage while the long prompt is in flight (check_invariants after each step), and it still
    continues as when appended alone."""
    path = checkpoint(MODEL)
    probe = _engine(path)
    slot_mb = probe.runner.hbm.slot_bytes * probe.model.config.num_layers / 2**20
    small: dict[str, Any] = {"hbm_mb": 8 * slot_mb, "ddr_mb": 60 * slot_mb, "ddr_high_watermark": 0.5}
    engine = _engine(path, ssd_path=str(tmp_path / "a"), **small)
    vocab = engine.model.config.vocab_size
    decoders = [_decoder(engine, vocab) for _ in range(3)]
    b = engine.create_session()
    engine.submit(b, token_ids=random_prompt(LONG, vocab, seed=6), generate=False)
    while any(r in engine.requests() for _, r in decoders) or b in {r.session.id for r in engine.requests().values()}:
        engine.step()
    assert engine.interleave.pauses > 0
    assert engine.tier_stats().ssd_write_count > 0  # spills happened while it was in flight
    out = [e.token_id for e in engine.generate(b, params=_params(8)) if isinstance(e, TokenDelta)]
    alone = _engine(path, ssd_path=str(tmp_path / "b"), **small)
    c = alone.create_session()
    alone.append(c, token_ids=random_prompt(LONG, vocab, seed=6))
    want = [e.token_id for e in alone.generate(c, params=_params(8)) if isinstance(e, TokenDelta)]
    assert out == want


def test_a_long_prompt_in_flight_gives_no_prefix(checkpoint: Callable[[str], Path]) -> None:
    """While a long prompt's pieces run, its table already holds its chunk's blocks, not written
    yet: a session that finds its prefix there copies nothing (`KVCache.frozen`) and computes it."""
    path = checkpoint(MODEL)
    engine = _engine(path)
    vocab = engine.model.config.vocab_size
    first = random_prompt(100, vocab, seed=3)
    long = engine.create_session()
    engine.append(long, token_ids=first)  # 99 tokens computed: 6 whole blocks
    rid = engine.submit(long, token_ids=random_prompt(LONG, vocab, seed=4), generate=False)
    engine.step()
    assert long_in_flight(engine) and engine.cached_tokens(long) > 200  # the chunk's rows are taken
    tokens = list(engine.session(long).tokens)
    other = engine.create_session()
    rid2 = engine.submit(other, token_ids=tokens[:400], generate=False)
    assert engine.cached_tokens(other) == 0 and engine.counters.prefix_queries == 2
    while rid in engine.requests() or rid2 in engine.requests():
        engine.step()
    got = [e.token_id for e in engine.generate(other, params=_params(8)) if isinstance(e, TokenDelta)]
    alone = _engine(path, share_prefixes="off")
    sid = alone.create_session()
    alone.append(sid, token_ids=tokens[:400])
    assert got == [e.token_id for e in alone.generate(sid, params=_params(8)) if isinstance(e, TokenDelta)]


def long_in_flight(engine: Engine) -> bool:
    return engine.interleave.current is not None and bool(engine.kv.frozen)
