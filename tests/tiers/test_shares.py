"""Fair HBM (h3d.tiers.shares): the rule, and the tiers brought to it as sessions come, go, idle
and pin.

The rule is checked as a property over random demands. The moves are checked on an engine with
HBM for 12 blocks per layer under `exact` and sessions of about 10 blocks: a random walk of
arrivals, departures, idling and pins, each followed by steps; after each settling the active
unpinned sessions hold at least their shares less their partial block, a pinned session never
loses a block, the bookkeeping invariants hold after every step (check_invariants), and every
session's tokens equal those of the same requests on an engine whose HBM holds everything.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_engine, random_prompt
from hypothesis import given
from hypothesis import strategies as st

from h3d.engine import engine as engine_module
from h3d.engine import sampling
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import TokenDelta
from h3d.tiers.shares import FLOOR_PART, shares

MODEL = "llama_gqa4_tied"


@given(st.integers(0, 500), st.lists(st.integers(0, 300), min_size=1, max_size=12))
def test_shares_follow_the_rule(capacity: int, demands: list[int]) -> None:
    d = np.array(demands)
    got = shares(capacity, d)
    n = len(d)
    assert (got >= 0).all() and (got <= d).all()
    assert got.sum() <= capacity
    assert (got >= np.minimum(d, int(FLOOR_PART * capacity) // n)).all()  # the floor
    if d.sum() <= capacity:
        assert (got == d).all()
    else:
        assert got.sum() >= capacity - n  # only rounding is left unshared
        # in proportion: one who wants more never gets less
        order = np.argsort(d, kind="stable")
        assert (np.diff(got[order]) >= 0).all()


@given(
    st.integers(0, 500),
    st.lists(st.tuples(st.integers(0, 300), st.integers(0, 400)), min_size=1, max_size=12),
)
def test_what_the_demands_leave_is_shared_equally_up_to_each_size(capacity: int, pairs: list[tuple[int, int]]) -> None:
    d, size = np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])
    got, base = shares(capacity, d, size), shares(capacity, d)
    top = np.maximum(d, size)
    assert (got >= base).all() and (got <= top).all()  # the demands first, never beyond what one has
    assert got.sum() == min(capacity, max(int(base.sum()), int(top.sum())))  # nothing left idle
    for j in np.flatnonzero(got < top):  # j wants more: nobody got more than one above j beyond its demand part
        assert (got <= np.maximum(base, got[j] + 1)).all(), (got, base, j)


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _tokens(events: list[Any]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in events:
        if isinstance(e, TokenDelta):
            out.setdefault(e.request_id, []).append(e.token_id)
    return out


class Walk:
    """The same requests on `engine`, remembered by name (for the comparison engine)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.sids: dict[str, Any] = {}
        self.rids: dict[int, str] = {}
        self.out: dict[str, list[int]] = {}

    def steps(self, n: int) -> None:
        e = self.engine
        for _ in range(n):
            e.upkeep()
            for rid, toks in _tokens(e.step()).items():
                self.out.setdefault(self.rids[rid], []).extend(toks)


def _walk(engine: Engine, seed: int, check: Callable[[Walk, str], None] | None) -> dict[str, list[int]]:
    rng = random.Random(seed)
    vocab = engine.model.config.vocab_size
    w = Walk(engine)
    for i in range(14):
        idle = [n for n, sid in w.sids.items() if not engine.session(sid).busy]
        busy = [n for n, sid in w.sids.items() if engine.session(sid).busy]
        move = rng.choice(["come", "come", "go", "go", "pin", "idle"] if w.sids else ["come"])
        if move == "come" and len(w.sids) < 5:
            name = f"s{i}"
            sid = w.sids[name] = engine.create_session()
            engine.append(sid, token_ids=random_prompt(rng.randint(200, 330), vocab, seed=seed * 100 + i))
            w.rids[engine.submit(sid, generate=True, params=_params(40))] = name
        elif move == "go" and idle:  # an idle session comes back
            name = rng.choice(idle)
            w.rids[engine.submit(w.sids[name], generate=True, params=_params(20))] = name
        elif move == "pin" and w.sids:
            name = rng.choice(sorted(w.sids))
            engine.set_pin(w.sids[name], None if engine.kv.sessions[engine.session(w.sids[name]).seq].pinned else 1e12)
        elif move == "idle" and busy:
            leaving = rng.choice(busy)
            for rid, name in list(w.rids.items()):
                if name == leaving and rid in engine.requests():
                    engine.cancel(rid)
        w.steps(12)
        if check is not None:
            check(w, move)
    while engine.requests():
        w.steps(1)
    return w.out


def test_hbm_shares_as_sessions_come_go_idle_and_pin(checkpoint: Callable[[str], Path]) -> None:
    path = checkpoint(MODEL)
    probe = make_engine(path)
    slot_mb = probe.runner.hbm.slot_bytes * probe.model.config.num_layers / 2**20
    small = make_engine(path, hbm_mb=12 * slot_mb, ddr_mb=200 * slot_mb, policy="exact", promote_mb_per_step=64.0)
    assert small.runner.blocks.slots_per_layer == 12
    pinned_held: dict[Any, np.ndarray] = {}
    checked = {"settled": 0}

    def check(w: Walk, move: str) -> None:
        kv = small.kv
        for sid in w.sids.values():
            seq = small.session(sid).seq
            held = kv.shares.held(seq)
            if kv.sessions[seq].pinned:
                if sid in pinned_held:
                    assert (held >= pinned_held[sid]).all(), "a pinned session lost HBM blocks"
                pinned_held[sid] = held
            else:
                pinned_held.pop(sid, None)
            share = kv.shares.target.get(seq)
            if share is not None and seq in {r.session.seq for r in small.requests().values()}:
                assert (held >= share - 1).all(), f"after '{move}': holds {held}, share {share}"
                checked["settled"] += 1

    got = _walk(small, seed=5, check=check)
    assert checked["settled"] >= 10
    stats = small.tier_stats()
    assert stats.hbm_rebalance_count > 0  # rebalancing moved blocks
    # Every copy up is a promotion or a fill (both counted in promote_count); demotions copied down
    block = small.runner.hbm.slot_bytes
    assert stats.copy_up_bytes == stats.promote_count * block > 0
    assert stats.copy_down_bytes > 0 and stats.copy_down_bytes % block == 0
    roomy = make_engine(path, policy="exact")
    want = _walk(roomy, seed=5, check=None)
    assert got == want


def _hit_rates_after_late_arrivals(engine: Engine, vocab: int) -> tuple[list[float], dict[str, list[int]]]:
    """Four sessions appended one after another (each append pushes the idle sessions' blocks down
    first, so HBM ends up holding mostly the last one's), then decoding 40 tokens together; each
    session's hit rate over the decode, and its tokens."""
    sids = [engine.create_session() for _ in range(4)]
    for i, sid in enumerate(sids):
        engine.append(sid, token_ids=random_prompt(640, vocab, seed=40 + i))
    kv = engine.kv
    seqs = [engine.session(sid).seq for sid in sids]
    before = [(kv.counters(s).hbm_hits, kv.counters(s).hbm_misses) for s in seqs]
    w = Walk(engine)
    for i, sid in enumerate(sids):
        w.rids[engine.submit(sid, generate=True, params=_params(40))] = f"s{i}"
    while engine.requests():
        w.steps(1)
    rates = []
    for s, (hits, misses) in zip(seqs, before, strict=True):
        c = kv.counters(s)
        rates.append((c.hbm_hits - hits) / max(1, c.hbm_hits - hits + c.hbm_misses - misses))
    return rates, w.out


def test_sessions_arriving_when_hbm_is_full_get_an_equal_part_of_it(checkpoint: Callable[[str], Path]) -> None:
    """A sparse policy reads a window of a few blocks per layer each step, but which blocks moves
    from step to step: a session that holds only its window's worth reads most of its picks from
    DDR, and HBF promotes little per step (as `promote_mb_per_step` allows on a large model). The
    four sessions' demands fit in HBM many times over, so the shares beyond them decide: every
    session must get an equal part of every layer, whenever it arrived, and the hit rates must
    stay close (the issue's bar for 32 x 32K on the H200: none below half the mean).
    The tokens equal those of an engine whose HBM holds everything."""
    path = checkpoint(MODEL)
    probe = make_engine(path)
    slot_mb = probe.runner.hbm.slot_bytes * probe.model.config.num_layers / 2**20
    sparse = dict(
        policy="attention_entropy", dense_layers=1, window_tokens=64, window_min_tokens=64, window_max_tokens=64,
        recent_tokens=16,
    )  # fmt: skip
    small = make_engine(
        path,
        hbm_mb=48 * slot_mb,
        ddr_mb=200 * slot_mb,
        promote_mb_per_step=2 * slot_mb,
        rebalance_mb_per_step=16 * slot_mb,
        **sparse,
    )
    assert 32 <= small.runner.blocks.slots_per_layer <= 48  # of the 4 x 43 blocks per layer (digests take some)
    vocab = small.model.config.vocab_size
    rates, got = _hit_rates_after_late_arrivals(small, vocab)
    assert min(rates) >= 0.5 * float(np.mean(rates)), rates
    assert min(rates) >= 0.85 * max(rates), rates  # without the equal parts: 0.36 to 0.50
    kv = small.kv
    held = np.stack([kv.shares.held(small.session(sid).seq) for sid in small.sessions])  # [4, L]
    assert (held.max(axis=0) - held.min(axis=0) <= 2).all(), held  # equal parts, within rounding and the partial block
    assert small.tier_stats().hbm_rebalance_count > 0
    _, want = _hit_rates_after_late_arrivals(make_engine(path, **sparse), vocab)
    assert got == want


def test_a_step_rebalances_once_between_queuing_its_argmax_and_reading_its_tokens(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's rebalance runs while the device computes (`Engine._run`): after the forward and
    its tokens' argmax are queued, before the tokens are read, once a step; upkeep no longer does
    it. (Its moves, and tokens equal to an engine whose HBM holds everything, are the tests above.)"""
    path = checkpoint(MODEL)
    probe = make_engine(path)
    slot_mb = probe.runner.hbm.slot_bytes * probe.model.config.num_layers / 2**20
    engine = make_engine(path, policy="exact", hbm_mb=12 * slot_mb, ddr_mb=200 * slot_mb)
    order: list[str] = []

    class Logged(sampling.Argmax):
        def __init__(self, logits: Any) -> None:
            order.append("argmax")
            super().__init__(logits)

        def tolist(self) -> list[int]:
            order.append("read")
            return super().tolist()

    monkeypatch.setattr(engine_module, "Argmax", Logged)
    rebalance = engine.kv.rebalance
    monkeypatch.setattr(engine.kv, "rebalance", lambda active: order.append("rebalance") or rebalance(active))
    vocab = engine.model.config.vocab_size
    sids = [engine.create_session() for _ in range(2)]
    for i, sid in enumerate(sids):
        engine.append(sid, token_ids=random_prompt(vocab, 100, seed=i))
    for sid in sids:
        engine.submit(sid, generate=True, params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert order.count("rebalance") == order.count("read") >= 2  # (the appends' steps: the same)
    order.clear()
    steps = 0
    while engine.has_work:
        engine.upkeep()
        assert order == [], order  # (upkeep moved nothing toward the shares)
        engine.step()
        steps += 1
        assert order == ["argmax", "rebalance", "read"], order
        order.clear()
    assert steps == 4
