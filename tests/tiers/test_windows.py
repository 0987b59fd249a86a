"""Sliding-window layers in the tiers: a window layer keeps only the blocks its window reads.

Its older blocks are freed in every tier as the context moves on (`BlockManager.drop_behind`),
never written behind, and carry no digests. Checked against an engine whose HBM holds
everything: the tokens are equal through the tiers, a park and reopen, a restart from the
archive (which then holds only each window layer's live blocks), and a rewind past the window
(which prefills the session again from its start).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import VOCAB_SIZE, make_engine, random_prompt

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId

MODEL = "qwen2_window_layers"  # 3 layers: layer 0 full, layers 1-2 a 24-token window; blocks of 16
WINDOW, BS = 24, 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
HBF: dict[str, Any] = {"policy": "attention_entropy", "window_tokens": 64, "window_min_tokens": 32,
                       "window_max_tokens": 128, "recent_tokens": 16, "dense_layers": 0}  # fmt: skip


def _engine(model: Path, folder: Path, **overrides: Any) -> Engine:
    kw: dict[str, Any] = {
        "ssd_path": str(folder / "archive"),
        "session_log_path": str(folder / "sessions"),
        "hbm_mb": 0.25,
        "ddr_mb": 0.25,
        "prefill_chunk_tokens": 64,
        "window_keep_tokens": 0,  # blocks freed as soon as no token reads them
        **HBF,
    }
    return make_engine(model, **(kw | overrides))


def _live(engine: Engine, sid: SessionId) -> list[int]:
    """Blocks each layer of `sid` keeps."""
    table = engine.runner.kv.blocks.table(engine.session(sid).seq)
    return table.live().sum(axis=1).tolist()


def _twin(checkpoint: Callable[[str], Path], ids: list[int], **overrides: Any) -> tuple[Engine, SessionId]:
    plain = make_engine(checkpoint(MODEL), hbm_mb=64.0, prefill_chunk_tokens=64, **(HBF | overrides))
    twin = plain.create_session()
    plain.append(twin, token_ids=ids)
    return plain, twin


def test_window_layers_keep_only_their_window(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """After 400 tokens the full layer holds all 25 blocks and each window layer the blocks of
    its window only (24 tokens: 2 or 3 blocks), whatever the tiers did; the freed blocks are
    counted, the window layers' HBM is reported apart, and the tokens equal an engine whose HBM
    holds everything (whose window layers are freed the same way: the oracle for that is the
    logits test of the tiers, `test_sliding_window_layers_tiered_equal_untiered`)."""
    ids = random_prompt(392, VOCAB_SIZE, seed=7)
    engine = _engine(checkpoint(MODEL), tmp_path)
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    got = engine.complete(sid, "", GREEDY).token_ids
    plain, twin = _twin(checkpoint, ids)
    assert got == plain.complete(twin, "", GREEDY).token_ids
    n = 392 + 7  # the last generated token is not fed yet
    live = _live(engine, sid)
    assert live[0] == -(-n // BS) == 25
    assert all(2 <= x <= -(-WINDOW // BS) + 1 for x in live[1:]), live
    stats = engine.tier_stats()
    assert stats.window_freed_blocks >= 2 * (25 - 3)
    slot = engine.runner.kv.hbm.slot_bytes
    assert 0 < stats.window_hbm_bytes <= 2 * 3 * slot
    # nothing of a window layer was written behind the window
    engine.runner.kv.snapshot(engine.session(sid).seq)
    archive = engine.runner.kv.archive
    assert archive is not None
    have = archive.blocks_of(engine.session(sid).id)
    assert {j for (layer, j) in have if layer == 0} == set(range(n // BS))
    for layer in (1, 2):
        assert {j for (lay, j) in have if lay == layer} <= set(range(n // BS - 3, n // BS))
    plain.close()
    engine.close()


def test_a_window_model_survives_park_and_restart(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Closed (parked: every live block archived, the copies dropped) and reopened, then
    checkpointed and restarted: the session continues from the archive with the tokens of an
    engine that never stopped, its whole context adopted (nothing prefilled again), each window
    layer adopted from its floor on."""
    ids = random_prompt(300, VOCAB_SIZE, seed=8)
    engine = _engine(checkpoint(MODEL), tmp_path)
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    plain, twin = _twin(checkpoint, ids)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    engine.close_session(sid)  # parked
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert engine.tier_stats().ssd_read_count > 0
    engine.checkpoint()
    engine.close()
    engine = _engine(checkpoint(MODEL), tmp_path)
    assert engine.tier_stats().kv_rebuild_blocks == 0  # the whole context adopted
    table = engine.runner.kv.blocks.table(engine.session(sid).seq)
    assert table.floor[0] == 0 and (table.floor[1:] > 0).all()
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert engine.tier_stats().kv_rebuild_blocks == 0
    plain.close()
    engine.close()


def test_a_rewind_past_the_window_prefills_again_and_one_within_it_does_not(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A rewind within the window keeps the KV before it; one past it drops the whole KV (a
    window layer's KV depends on a cone of earlier positions: only a prefill from the start
    computes it again exactly). Either way the next tokens are those of an engine given the
    kept tokens as its prompt (under `exact`: HBF's state would differ, its prompt probe being the
    twin's prompt)."""
    ids = random_prompt(200, VOCAB_SIZE, seed=9)
    engine = _engine(checkpoint(MODEL), tmp_path, policy="exact")
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    engine.complete(sid, "", GREEDY)
    n = len(engine.session(sid).tokens)
    engine.rewind(sid, n - 4)
    assert engine.cached_tokens(sid) == n - 5  # the last kept token: fed by the next request
    for keep in (n - 4, 120):
        engine.rewind(sid, keep)
        if keep == 120:
            assert engine.cached_tokens(sid) == 0
        plain, twin = _twin(checkpoint, engine.session(sid).tokens[:keep], policy="exact")
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
        plain.close()
    assert np.isfinite(engine.tier_stats().hbm_hit_rate)
    engine.close()


def test_the_window_entropy_comes_from_the_first_layer_that_selects(checkpoint: Callable[[str], Path]) -> None:
    """`attention_entropy` resizes its window from a decode step's block-score entropy, taken in
    the first layer past the dense ones that selects: with Gemma's pattern (sliding, sliding,
    global) and no dense layer, the global one. Decode steps past the window record it."""
    engine = make_engine(checkpoint("gemma3_window"), **(HBF | {"dense_layers": 0}))
    windows = engine.model.config.windows
    assert windows[0] is not None and windows[-1] is None
    first_full = next(i for i, w in enumerate(windows) if w is None)
    assert engine.runner.hbf.entropy_at == first_full > 0
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(200, VOCAB_SIZE, seed=10))
    engine.complete(sid, "", GREEDY)
    state = engine.runner.kv.selection(engine.session(sid).seq)
    assert state.current_entropy is not None or state.entropies
    engine.close()


def test_window_keep_tokens_keeps_a_short_rewind_s_kv(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """With `window_keep_tokens` = 64 a window layer keeps its blocks 64 tokens past its window: a
    rewind that far back keeps the KV before it, one further prefills the session again; the tokens
    are those of an engine given the kept tokens as its prompt either way."""
    ids = random_prompt(200, VOCAB_SIZE, seed=11)
    engine = _engine(checkpoint(MODEL), tmp_path, policy="exact", window_keep_tokens=64)
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    engine.complete(sid, "", GREEDY)
    n = len(engine.session(sid).tokens)  # 208: 207 cached, floor (207 - 24 + 1 - 64) // 16 = 7
    assert engine.runner.kv.blocks.table(engine.session(sid).seq).floor.tolist() == [0, 7, 7]
    for keep, cached in ((150, 149), (120, 0)):  # a cut to t needs blocks from (t - 24) // 16 on
        engine.rewind(sid, keep)
        assert engine.cached_tokens(sid) == cached and n > keep
        plain, twin = _twin(checkpoint, engine.session(sid).tokens[:keep], policy="exact")
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
        plain.close()
    engine.close()


def test_a_window_block_freed_while_it_is_read_ahead_is_not_placed(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart, read-ahead brings a session's archived blocks back into DDR on its own
    threads. A sliding layer's block freed while its piece is in flight (the context moved past it)
    gets no copy when the piece lands: its slot is given back, and the null entry stays empty."""
    ids = random_prompt(300, VOCAB_SIZE, seed=12)
    engine = _engine(checkpoint(MODEL), tmp_path)
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    engine.complete(sid, "", GREEDY)
    engine.checkpoint()
    engine.close()
    engine = _engine(checkpoint(MODEL), tmp_path, read_ahead_at_start=False)  # (started below, held)
    tiers, kv = engine.runner.tiers, engine.runner.kv
    seq = engine.session(sid).seq
    gate = threading.Event()
    read_into = tiers.mover.read_into

    def held(keys: list[Any], slots: np.ndarray, fence: list[Any]) -> None:
        assert gate.wait(10)
        read_into(keys, slots, fence)

    monkeypatch.setattr(tiers.mover, "read_into", held)
    table = tiers.blocks.table(seq)
    nb, before = table.num_blocks, table.floor.copy()
    first = np.zeros((3, nb), dtype=bool)
    first[1:, before[1] : nb - 1] = True  # the window layers' full blocks: read ahead first
    tiers.ahead.start(seq, first)
    assert engine.read_ahead() and tiers.ahead.pieces
    in_flight = {(int(layer), int(j)) for p in tiers.ahead.pieces for layer, j in zip(p.layers, p.blocks, strict=True)}
    # as if the context had moved on: the window layers keep their last two blocks
    assert kv.drop_behind(seq, (nb - 2) * BS + WINDOW - 1) > 0 and table.floor[1] == nb - 2
    freed = {(layer, j) for layer in (1, 2) for j in range(before[layer], nb - 2)}
    assert freed and freed <= in_flight  # the freed blocks were being read
    gate.set()
    tiers.ahead.poll(wait=True)
    kv.check()  # the null entry has no copy; every slot is owned once or free
    assert not (table.ddr[1:, : table.floor[1]] != -1).any()
    engine.close()
