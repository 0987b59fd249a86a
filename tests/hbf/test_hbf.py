"""HBF: digests, selection and hotness eviction."""

from __future__ import annotations

import itertools
import math
import unittest.mock
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.hbf.digests import DigestStore, block_scores, joined
from h3d.hbf.policy import POLICIES, SelectionState
from h3d.kv.blocks import NONE, SeqId
from tests.helpers import make_engine, random_prompt

BS = 16


@settings(max_examples=60, deadline=None)
@given(
    hkv=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 4]),
    n=st.integers(1, 70),
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
)
def test_digest_bound_is_at_least_every_true_score(hkv: int, group: int, n: int, seed: int, magnitude: float) -> None:
    """For every block, the Quest bound >= the best q.k of any key in it, for every query head."""
    g = torch.Generator().manual_seed(seed)
    d = 16
    k = torch.randn(n, hkv, d, generator=g) * magnitude  # [n, Hkv, D]
    q = torch.randn(hkv * group, d, generator=g)  # [H, D]
    store = DigestStore(1, hkv, d, BS, torch.float32, torch.device("cpu"))
    split = int(torch.randint(0, n + 1, (1,), generator=g))  # two writes: the partial block grows
    store.update(SeqId(1), 0, 0, k[:split])
    store.update(SeqId(1), 0, split, k[split:])
    nb = -(-n // BS)
    bound = block_scores(q, store.get(SeqId(1), 0, nb))  # [nb]
    true = torch.einsum(
        "hd,nhd->nh",
        q.view(hkv, group, d).repeat_interleave(1, 0).reshape(-1, d)[: hkv * group],
        k.repeat_interleave(group, 1),
    )
    best = torch.stack([true[j * BS : (j + 1) * BS].max() for j in range(nb)])
    assert (bound >= best - 1e-4 * magnitude * d).all()


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 90),
    cuts=st.lists(st.integers(0, 90), max_size=3),
    part=st.sampled_from([4, 8, 16]),
    seed=st.integers(0, 2**31 - 1),
    scatter=st.sampled_from([0, 256]),
)
def test_digests_are_each_parts_min_and_max(n: int, cuts: list[int], part: int, seed: int, scatter: int) -> None:
    """Keys written in pieces of any length (whole parts reduced at once, partial ones folded in
    by scatter; or, `SCATTER_KEYS` at most, every key by scatter) give exactly each part's
    element-wise min and max of its keys."""
    from h3d.hbf import digests

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, 2, 8, generator=g)  # [n, Hkv, D]
    store = DigestStore(1, 2, 8, BS, torch.float32, torch.device("cpu"), part)
    edges = sorted({0, n, *(c for c in cuts if c < n)})
    with unittest.mock.patch.object(digests, "SCATTER_KEYS", scatter):
        for a, b in itertools.pairwise(edges):
            store.update(SeqId(1), 0, a, k[a:b])
    nb = -(-n // BS)
    got = store.get(SeqId(1), 0, nb).reshape(2, -1, 2, 8)  # [Hkv, parts, (min, max), D]
    for j in range(-(-n // part)):
        keys = k[j * part : (j + 1) * part].transpose(0, 1)  # [Hkv, t, D]
        assert torch.equal(got[:, j, 0], keys.amin(dim=1)) and torch.equal(got[:, j, 1], keys.amax(dim=1))


def test_sessions_filling_the_reserved_arena_never_grow_it() -> None:
    """An arena reserved for 64 blocks a layer (the tiers' blocks, as on a GPU): eight sessions
    growing a token at a time to 8 blocks each fill it exactly without a second arena (the growth
    slack shrinks to what is left); their digests stay their keys'."""
    store = DigestStore(2, 2, 8, BS, torch.float32, torch.device("cpu"), 8, blocks=64)
    g = torch.Generator().manual_seed(0)
    keys = {SeqId(s): torch.randn(8 * BS, 2, 8, generator=g) for s in range(1, 9)}
    for t in range(8 * BS):
        for seq, k in keys.items():
            for layer in range(2):
                store.update(seq, layer, t, k[t : t + 1] + layer)
    assert store.generation == 0 and store.rows == store.parts * 65
    for seq, k in keys.items():
        got = store.get(seq, 1, 8).reshape(2, -1, 2, 8)
        part = BS // store.parts
        first = k[:part].transpose(0, 1) + 1  # [Hkv, t, D]
        assert torch.equal(got[:, 0, 0], first.amin(dim=1)) and torch.equal(got[:, 0, 1], first.amax(dim=1))


def test_sessions_decoding_side_by_side_in_a_full_arena_compact_it_rarely() -> None:
    """32 sessions whose prompts fill two thirds of the reserved arena (as on a GPU with the
    tiers filling up) decode 400 tokens each, in turns, to nine tenths of it: when one must
    move, the others' slack is shared out anew, so the arena is packed a few dozen times, not at
    most new parts (164 times when the moving session's slack was taken back from all of them);
    every session's digests stay its keys'."""
    sessions, blocks, steps = 32, 64, 400
    store = DigestStore(1, 1, 4, BS, torch.float32, torch.device("cpu"), 4, blocks=sessions * blocks * 113 // 100 + 800)
    g = torch.Generator().manual_seed(1)
    keys = {SeqId(s): torch.randn(blocks * BS + steps, 1, 4, generator=g) for s in range(sessions)}
    for seq, k in keys.items():
        store.reserve(seq, blocks)
        store.update(seq, 0, 0, k[: blocks * BS])
    for t in range(blocks * BS, blocks * BS + steps):
        for seq, k in keys.items():
            store.update(seq, 0, t, k[t : t + 1])
    assert store.generation == 0 and store.compactions <= 40
    part = BS // store.parts
    full = (blocks * BS + steps) // part  # parts whose keys are all written
    for seq, k in keys.items():
        got = store.get(seq, 0, -(-full // store.parts)).reshape(1, -1, 2, 4)
        for j in (0, blocks * store.parts, full - 1):
            chunk = k[j * part : (j + 1) * part].transpose(0, 1)
            assert torch.equal(got[:, j, 0], chunk.amin(dim=1)) and torch.equal(got[:, j, 1], chunk.amax(dim=1))


def _cut(store: DigestStore, keys: dict[SeqId, torch.Tensor], seq: SeqId, n: int) -> None:
    """`seq` cut back to n % its keys (dropped at 0), in the store and in `keys` (layer l's keys + l)."""
    kept = n % len(keys[seq])
    if kept == 0:
        store.drop(seq)
        del keys[seq]
        return
    keep = keys[seq][:kept]
    store.truncate(seq, kept, lambda layer, start: keep[start:] + layer)
    keys[seq] = keep


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 40), st.booleans()), min_size=1, max_size=40))
def test_digest_arena_keeps_each_sessions_digests_through_moves(ops: list[tuple[int, int, bool]]) -> None:
    """Four sessions growing, cut and dropped in any order share one arena: every session's
    digests stay each part's min and max of its own keys while extents grow in place, move,
    are compacted and the arena is resized (its `generation` counts the replacements); extents
    never overlap the null extent or each other, and rows past a session's keys are empty."""
    g = torch.Generator().manual_seed(len(ops))
    store = DigestStore(2, 2, 8, BS, torch.float32, torch.device("cpu"), 8)
    keys: dict[SeqId, torch.Tensor] = {}  # each session's keys so far [n, Hkv, D]
    generations = [store.generation]
    for who, n, drop in ops:
        seq = SeqId(who)
        if drop and seq in keys and n % 3 == 0:
            store.drop(seq)
            del keys[seq]
            continue
        have = keys.get(seq, torch.empty(0, 2, 8))
        if drop and len(have):  # cut back to n % len keys
            _cut(store, keys, seq, n)
            continue
        if not n:
            continue
        new = torch.randn(n, 2, 8, generator=g)
        for layer in range(2):
            store.update(seq, layer, len(have), new + layer)
        keys[seq] = torch.cat([have, new])
        generations.append(store.generation)
    assert generations == sorted(generations)
    spans = sorted((store.base(s), store.base(s) + store.layer(s, 0).shape[1]) for s in keys)
    assert all(a >= store.parts for a, _ in spans)  # the null extent is no session's
    assert all(b1 <= a2 for (_, b1), (a2, _) in itertools.pairwise(spans)) and (not spans or spans[-1][1] <= store.rows)
    for seq, k in keys.items():
        nb = -(-len(k) // BS)
        for layer in range(2):
            got = store.layer(seq, layer)  # [Hkv, capacity, 2, D]
            parts = -(-len(k) // 8)
            for j in range(parts):
                part = (k[j * 8 : (j + 1) * 8] + layer).transpose(0, 1)  # [Hkv, t, D]
                assert torch.equal(got[:, j, 0], part.amin(dim=1)) and torch.equal(got[:, j, 1], part.amax(dim=1))
            assert (got[:, parts:, 0] == torch.finfo(torch.float32).max).all()  # empty past its keys
            assert torch.equal(store.get(seq, layer, nb).reshape(2, -1, 2, 8), got[:, : nb * store.parts])


@settings(max_examples=120, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["grow", "fork", "fork", "cut", "drop", "rewrite"]),
            st.integers(0, 2),
            st.integers(0, 2),
            st.integers(0, 50),
        ),
        min_size=1,
        max_size=60,
    )
)
def test_shared_digest_rows_read_as_each_sessions_own(ops: list[tuple[str, int, int, int]]) -> None:
    """Sessions forked from others at whole blocks share their first rows (`DigestStore.share`),
    then grow, fork again, are cut, dropped and their blocks' keys folded in again, in any order,
    as extents move and the arena is packed and resized: every session's digests (`get`, `head`,
    and the rows a selection kernel reads: `source` below `shared`, `base` above) stay each part's
    min and max of its own keys; a source exists for every reader, its rows are all its own, and
    the rows shared are those saved."""
    g = torch.Generator().manual_seed(len(ops))
    store = DigestStore(2, 2, 8, BS, torch.float32, torch.device("cpu"), 8)
    keys: dict[SeqId, torch.Tensor] = {}
    for seq in map(SeqId, range(2)):  # two sessions of 3 blocks and some to start with
        keys[seq] = torch.randn(3 * BS + 5, 2, 8, generator=g)
        for layer in range(2):
            store.update(seq, layer, 0, keys[seq] + layer)
    for op, who, other, n in ops:
        seq, peer = SeqId(who), SeqId(other)
        have = keys.get(seq, torch.empty(0, 2, 8))
        if op == "fork" and peer in keys and peer != seq and len(keys[peer]) >= BS:
            blocks = 1 + n % (len(keys[peer]) // BS)
            tail = len(keys[peer]) - blocks * BS if n % 2 else 0  # (a whole fork copies the partial block)
            if tail >= BS:
                tail = 0
            store.share(seq, peer, blocks, 1 if tail else 0)
            keys[seq] = keys[peer][: blocks * BS + tail].clone()
        elif op == "drop" and seq in keys:
            store.drop(seq)
            del keys[seq]
        elif op == "cut" and len(have):
            _cut(store, keys, seq, n)
        elif op == "rewrite" and len(have):  # a block's keys folded in again (a repair): the same keys
            first = (n % len(have)) // BS * BS
            for layer in range(2):
                store.update(seq, layer, first, have[first : first + BS] + layer)
        elif op == "grow" and n:
            new = torch.randn(n, 2, 8, generator=g)
            for layer in range(2):
                store.update(seq, layer, len(have), new + layer)
            keys[seq] = torch.cat([have, new])
    assert set(keys) <= {s for s in map(SeqId, range(4)) if store.has(s)}
    saved = 0
    for seq, k in keys.items():
        src, shared = store.source(seq)
        saved += shared
        if shared:
            root = store._extents[seq].src
            assert root in keys and store.source(root) == (0, 0) and len(keys[root]) >= shared * 8
        nb = -(-len(k) // BS)
        parts = -(-len(k) // 8)
        for layer in range(2):
            runs = store.get(seq, layer, nb)  # two views where it shares: scored as one
            got = joined(runs).reshape(2, -1, 2, 8)
            q = torch.randn(4, 8, generator=g)
            want = block_scores(q, joined(runs), per_head=True)
            torch.testing.assert_close(block_scores(q, runs, per_head=True), want, rtol=1e-6, atol=1e-6)
            arena = store.arena(layer)
            rows = [src + j if j < shared else store.base(seq) + j for j in range(parts)]
            assert torch.equal(arena[:, rows], got[:, :parts])  # what the kernels read
            for j in range(parts):
                part = (k[j * 8 : (j + 1) * 8] + layer).transpose(0, 1)
                assert torch.equal(got[:, j, 0], part.amin(dim=1)) and torch.equal(got[:, j, 1], part.amax(dim=1))
            assert (got[:, parts:, 0] == torch.finfo(torch.float32).max).all()  # empty past its keys
        assert torch.equal(
            store.head(seq, nb)[1].reshape(2, -1, 2, 8), joined(store.get(seq, 1, nb)).reshape(2, -1, 2, 8)
        )
    assert store.shared_parts() == saved


def test_a_sources_changes_leave_its_readers_digests_as_they_were() -> None:
    """A fork reads its parent's rows until they would change: the parent cut below what the fork
    shares, or dropped, or the fork's own keys folded in below it; a fork of the fork shares the
    first parent's rows, and one past them copies. Each session's digests stay its keys'."""
    g = torch.Generator().manual_seed(3)
    store = DigestStore(1, 2, 8, BS, torch.float32, torch.device("cpu"), 8)
    keys = {SeqId(0): torch.randn(5 * BS + 3, 2, 8, generator=g)}
    store.update(SeqId(0), 0, 0, keys[SeqId(0)])

    def exact(seq: SeqId) -> bool:
        k = keys[seq]
        got = joined(store.get(seq, 0, -(-len(k) // BS))).reshape(2, -1, 2, 8)
        want = [k[j : j + 8].transpose(0, 1) for j in range(0, len(k), 8)]
        return all(torch.equal(got[:, j, 0], w.amin(dim=1)) and torch.equal(got[:, j, 1], w.amax(dim=1))
                   for j, w in enumerate(want))  # fmt: skip

    def fork(child: int, parent: int, blocks: int) -> None:
        store.share(SeqId(child), SeqId(parent), blocks)
        keys[SeqId(child)] = keys[SeqId(parent)][: blocks * BS].clone()

    fork(1, 0, 4)
    fork(2, 1, 2)  # within what 1 shares: 0's rows
    assert store.source(SeqId(2)) == (store.source(SeqId(1))[0], 2 * store.parts) == (store.base(SeqId(0)), 4)
    more = torch.randn(BS, 2, 8, generator=g)
    store.update(SeqId(1), 0, 4 * BS, more)  # 1 grows past what it shares
    keys[SeqId(1)] = torch.cat([keys[SeqId(1)], more])
    fork(3, 1, 5)  # past what 1 shares: copied
    assert store.source(SeqId(3)) == (0, 0) and store.shared_parts() == (4 + 2) * store.parts
    assert all(exact(s) for s in keys)
    store.truncate(
        SeqId(0), 3 * BS + 5, lambda layer, start: keys[SeqId(0)][start : 3 * BS + 5]
    )  # below 1's four blocks
    keys[SeqId(0)] = keys[SeqId(0)][: 3 * BS + 5]
    assert store.source(SeqId(1)) == (0, 0) and store.source(SeqId(2))[1] == 4  # (2 shares below the cut)
    assert all(exact(s) for s in keys)
    store.update(SeqId(2), 0, BS, keys[SeqId(2)][BS : 2 * BS])  # a block's keys folded in again, below what it shares
    assert store.source(SeqId(2)) == (0, 0) and exact(SeqId(2))
    fork(4, 0, 3)
    store.drop(SeqId(0))
    del keys[SeqId(0)]
    assert store.source(SeqId(4)) == (0, 0) and store.shared_parts() == 0
    assert all(exact(s) for s in keys)


@pytest.mark.parametrize("policy", ["fixed", "attention_entropy", "layerwise"])
@pytest.mark.parametrize("num_blocks", [5, 40, 130])
def test_selection_keeps_sinks_and_recent_window(policy: str, num_blocks: int) -> None:
    cfg = replace(EngineConfig(), policy=policy, window_tokens=512, sink_blocks=2, recent_tokens=64, dense_layers=1).hbf
    state = SelectionState(POLICIES[policy], cfg.window_tokens)
    g = torch.Generator().manual_seed(num_blocks)
    digests = torch.randn(2, num_blocks, 2, 16, generator=g).sort(dim=2).values  # [Hkv, nb, (min, max), D]
    sel = state.policy.select(state, cfg, 3, torch.randn(4, 16, generator=g), digests, num_blocks, BS, 0.25)
    if num_blocks * BS <= cfg.window_tokens:
        assert sel is None  # everything fits the budget: all blocks are read
        return
    assert sel is not None
    rows = sel if sel.ndim == 2 else sel[None]  # attention_entropy: one row per KV head
    assert len(rows) == (2 if policy == "attention_entropy" else 1)
    for row in rows:
        assert {0, 1} <= set(row.tolist())
        assert set(range(num_blocks - 64 // BS, num_blocks)) <= set(row.tolist())
        assert len(row) <= cfg.window_tokens // BS and (np.diff(row) > 0).all()
    assert (
        state.policy.select(state, cfg, 0, torch.randn(4, 16), digests, num_blocks, BS, 0.25) is None
    )  # a dense layer


def test_attention_entropy_selects_each_kv_heads_top_blocks() -> None:
    """Each KV head gets its own top blocks by its group's bound: a block only one head scores
    high is read by that head, even when the other head's scores are all larger."""
    cfg = replace(EngineConfig(), window_tokens=4 * BS, sink_blocks=1, recent_tokens=BS, dense_layers=0).hbf
    state = SelectionState(POLICIES["attention_entropy"], cfg.window_tokens)
    nb, d = 12, 16
    digests = torch.zeros(2, nb, 2, d)
    digests[1, :, :, 0] = 5.0  # head 1: every block scores 5 (q = e0), far above head 0's
    digests[1, 7, :, 0] = 9.0  # its best blocks: 7 and 3
    digests[1, 3, :, 0] = 8.0
    digests[0, 4, :, 0] = 1.0  # head 0: blocks 4 and 9 only, scoring 1 and 0.5
    digests[0, 9, :, 0] = 0.5
    q = torch.zeros(4, d)
    q[:, 0] = 1.0
    sel = state.policy.select(state, cfg, 0, q, digests, nb, BS, 0.25)
    assert sel is not None and sel.tolist() == [[0, 4, 9, 11], [0, 3, 7, 11]]


def test_attention_entropy_reads_each_heads_prompt_anchors_first() -> None:
    """Up to anchor_share of the room past sinks and recent goes to the head's prompt anchors, best
    first, even where the digest bound ranks them last; the bound fills the rest (and everything
    with anchor_share 0)."""
    cfg = replace(EngineConfig(), window_tokens=6 * BS, sink_blocks=1, recent_tokens=BS, dense_layers=0).hbf
    state = SelectionState(POLICIES["attention_entropy"], cfg.window_tokens)
    nb, d = 20, 16
    digests = torch.zeros(2, nb, 2, d)
    digests[:, :, :, 0] = torch.arange(nb, dtype=torch.float32)[None, :, None]  # the bound ranks by index
    q = torch.zeros(4, d)
    q[:, 0] = 1.0
    state.head_anchors[0] = torch.tensor([[2, 5, 3, 9], [6, 1, 4, 8]])  # [Hkv, n], best first
    sel = state.policy.select(state, cfg, 0, q, digests, nb, BS, 0.25)
    room = 6 - 2  # the sink and the partial block take 2 of the window's 6 blocks
    assert int(room * cfg.anchor_share) == 2 and sel is not None
    assert sel.tolist() == [sorted([0, 19, 2, 5, 18, 17]), sorted([0, 19, 6, 1, 18, 17])]
    none = state.policy.select(state, replace(cfg, anchor_share=0.0), 0, q, digests, nb, BS, 0.25)
    assert none is not None and none.tolist() == [[0, 15, 16, 17, 18, 19]] * 2


@pytest.mark.parametrize("policy", ["fixed", "attention_entropy", "layerwise", "exact"])
@given(num_blocks=st.integers(1, 60), seed=st.integers(0, 2**16), share=st.sampled_from([0.0, 0.5, 1.0]))
@settings(max_examples=40, deadline=None)
def test_known_blocks_are_read_by_every_selection(policy: str, num_blocks: int, seed: int, share: float) -> None:
    """`Policy.known` (what a resumed session reads ahead before its first step) lies within
    the selection of any query (None exactly where every block is read), and is no more than
    the base and the anchors."""
    cfg = replace(
        EngineConfig(), policy=policy, window_tokens=8 * BS, sink_blocks=1, recent_tokens=BS, dense_layers=1,
        anchor_share=share,
    ).hbf  # fmt: skip
    state = SelectionState(POLICIES[policy], cfg.window_tokens)
    g = torch.Generator().manual_seed(seed)
    state.head_anchors[2] = torch.randint(0, num_blocks + 3, (2, 5), generator=g)  # some past the end
    state.anchors[2] = np.unique(torch.randint(0, num_blocks, (6,), generator=g).numpy())
    for layer in (0, 2):
        known = state.policy.known(state, cfg, layer, num_blocks, BS)
        for _ in range(3):
            digests = torch.randn(2, num_blocks, 2, 16, generator=g).sort(dim=2).values
            sel = state.policy.select(state, cfg, layer, torch.randn(4, 16, generator=g), digests, num_blocks, BS, 1.0)
            if sel is None:
                assert known is None
                continue
            assert known is not None and set(known.tolist()) <= set(np.unique(np.asarray(sel)).tolist())
            assert len(known) <= 1 + 1 + 2 * 5 + 6


def _probe_oracle(q: torch.Tensor, k: torch.Tensor, m: int, block_size: int, scale: float) -> torch.Tensor:
    """The prompt probe's ranking, plainly: each KV head's group of the last m queries, a softmax
    over every key it may see (causal among the last m), the mass summed per block. q: [n, H, D],
    k: [Hkv, T, D] -> [Hkv, blocks]."""
    hkv, t, _ = k.shape
    g = q.shape[1] // hkv
    nb = -(-t // block_size)
    out = torch.zeros(hkv, nb, dtype=torch.float64)
    for h in range(hkv):
        for i in range(m):
            pos = t - m + i  # this query's position: it sees keys 0..pos
            for j in range(g):
                w = torch.softmax((k[h, : pos + 1].double() @ q[-m + i, h * g + j].double()) * scale, dim=0)
                for b in range(nb):
                    out[h, b] += w[b * block_size : (b + 1) * block_size].sum()
    return out


@pytest.mark.parametrize(
    ("scores_bytes", "kernel", "cut"),
    [(256 << 20, False, 0), (1, False, 0), (256 << 20, False, 7 * BS + 3), (0, True, 0), (0, True, 7 * BS + 3)],
    ids=["twin", "twin-head-by-head", "twin-segments", "kernel", "kernel-segments"],
)
def test_the_prompt_probe_ranks_blocks_by_the_attention_they_draw(
    scores_bytes: int, kernel: bool, cut: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`probe_anchors` against a plain softmax per query and head (the torch twin with all KV heads
    scored at once, or one at a time; the kernels of `h3d.kernels.probe` under Triton's
    interpreter, as a GPU runs them; the keys whole or in two segments, as a prefill over a cached
    prefix passes them): each head's anchors are its best blocks by the mass they draw, best first,
    outside sinks and the recent window; the summed ranking gives layerwise's, taken from the
    device only once they are read (a prefill's layers do not wait for them)."""
    from h3d.hbf import policy as policy_module
    from h3d.kernels import loader, probe

    monkeypatch.setattr(policy_module, "PROBE_SCORES_BYTES", scores_bytes)
    monkeypatch.setattr(probe, "applies", lambda device: kernel and loader.runs_on(device))
    g = torch.Generator().manual_seed(3)
    hkv, heads, d, t, m = 2, 4, 16, 13 * BS + 5, policy_module.PROBE_QUERIES  # (the chunk's last m queries)
    q, k = torch.randn(m + 3, heads, d, generator=g), torch.randn(hkv, t, d, generator=g)
    cfg = replace(EngineConfig(), window_tokens=5 * BS, window_max_tokens=8 * BS, sink_blocks=1,
                  recent_tokens=BS, dense_layers=0).hbf  # fmt: skip
    state = SelectionState(POLICIES["attention_entropy"], cfg.window_tokens)
    keys = [k[:, :cut], k[:, cut:]] if cut else k
    policy_module.probe_anchors(state, cfg, 0, q, keys, BS, 0.25)
    want = _probe_oracle(q, k, m, BS, 0.25)
    base = [0, 13]  # the sink and the recent (partial) block
    want[:, base] = -1.0
    best = torch.argsort(want, dim=1, descending=True)[:, : 8 - 2]
    assert state.head_anchors[0].tolist() == best.tolist()
    summed = torch.argsort(want.sum(0), descending=True)[: 5 - 2]
    # layerwise's anchors wait, as the device's copy of them would, until they are read
    assert 0 in state.anchors_pending and 0 not in state.anchors_host
    assert state.anchors[0].tolist() == sorted(summed.tolist())
    assert not state.anchors_pending and state.anchors_host[0].tolist() == sorted(summed.tolist())
    state.anchors = {1: np.array([4])}  # a restored or copied set replaces what was pending
    policy_module.probe_anchors(state, cfg, 0, q, k, BS, 0.25)
    state.anchors = {1: np.array([4])}
    assert not state.anchors_pending and {k: v.tolist() for k, v in state.anchors.items()} == {1: [4]}


def test_prompt_anchors_are_probed_at_the_prompts_last_chunk(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """attention_entropy probes once per sparse layer, at the chunk that ends the prompt; each KV
    head's anchors lie outside sinks and the recent window, best first, at most the largest window."""
    import h3d.engine.stepkv as stepkv_module
    from h3d.hbf.policy import probe_anchors

    ckpt = checkpoint("llama_gqa4_tied")
    engine = make_engine(
        ckpt, policy="attention_entropy", window_tokens=128, window_min_tokens=128, window_max_tokens=256,
        recent_tokens=32, dense_layers=1, prefill_chunk_tokens=128,
    )  # fmt: skip
    calls: list[tuple[int, int]] = []  # (layer, queries)

    def spy(state, cfg, layer, q, k, block_size, scale):  # type: ignore[no-untyped-def]
        calls.append((layer, q.shape[0]))
        probe_anchors(state, cfg, layer, q, k, block_size, scale)

    monkeypatch.setattr(stepkv_module, "probe_anchors", spy)
    s = engine.create_session()
    engine.append(s, token_ids=random_prompt(600, 512, seed=5))  # 599 tokens fed: 5 chunks
    assert [layer for layer, _ in calls] == [0, 1, 2]  # one chunk probed: the last (layer 0 returns early)
    assert calls[0][1] == 599 - 4 * 128
    seq = engine.session(s).seq
    state = engine.kv.selection(seq)
    nb = engine.runner.blocks.table(seq).num_blocks
    assert set(state.head_anchors) == {1, 2}
    for anchors in state.head_anchors.values():
        assert anchors.shape == (2, min(256 // BS - 3, nb - 3))  # two KV heads; base: 1 sink + 2 recent
        assert not set(anchors.flatten().tolist()) & {0, nb - 2, nb - 1}


@pytest.mark.parametrize("policy", ["fixed", "attention_entropy", "layerwise"])
def test_budget_at_least_the_context_gives_exact_tokens(policy: str, checkpoint: Callable[[str], Path]) -> None:
    ckpt = checkpoint("llama_gqa4_tied")
    prompt = random_prompt(200, 512, seed=7)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = {}
    for p in ("exact", policy):
        engine = make_engine(ckpt, policy=p, window_tokens=1024, window_max_tokens=1024)
        s = engine.create_session()
        engine.append(s, token_ids=prompt)
        out[p] = engine.complete(s, "", params).token_ids
    assert out[policy] == out["exact"]


def test_selection_reads_a_subset_and_hotness_never_evicts_protected_blocks(checkpoint: Callable[[str], Path]) -> None:
    ckpt = checkpoint("llama_gqa4_tied")
    # A window of 4 blocks over a 40-block context, HBM of 6 blocks per layer: promotions must evict.
    probe = make_engine(ckpt)
    layers, slot_bytes = probe.model.config.num_layers, probe.runner.hbm.slot_bytes
    cfg = EngineConfig.build(
        model=str(ckpt), block_size=BS, policy="attention_entropy", window_tokens=64, window_min_tokens=64,
        recent_tokens=16, sink_blocks=1, dense_layers=0, hbm_mb=6.5 * layers * slot_bytes / 2**20,
        check_invariants=True,
    )  # fmt: skip
    engine = Engine(cfg)
    runner = engine.runner
    assert runner.blocks.slots_per_layer == 6
    s = engine.create_session()
    engine.append(s, token_ids=random_prompt(640, 512, seed=3))
    evicted_protected: list[tuple[int, int]] = []
    original = runner.kv.promoter.promote

    def spy(selected, protect, keep, counted=False):  # type: ignore[no-untyped-def]
        t = runner.blocks.table(seq)
        before = t.hbm.copy()
        original(selected, protect, keep, counted)
        after = runner.blocks.table(seq).hbm
        limit = protect.get(seq, t.num_blocks)
        keys = selected.get(seq, np.empty(0, dtype=np.int64))
        for layer in range(t.hbm.shape[0]):
            sel = np.unique(keys[keys // t.capacity == layer] % t.capacity)
            kept = np.union1d(sel, keep[seq])
            kept = kept[kept < limit]
            gone = kept[(before[layer, kept] != NONE) & (after[layer, kept] == NONE)]
            evicted_protected.extend((layer, int(j)) for j in gone)

    seq = engine.session(s).seq
    runner.kv.promoter.promote = spy  # type: ignore[method-assign]
    engine.complete(s, "", SamplingParams(max_tokens=20, ignore_eos=True))
    stats = engine.tier_stats()
    assert stats.hbm_hit_rate < 1.0 and stats.hbm_evict_count > 0
    assert evicted_protected == []


def test_switching_policy_rebuilds_digests_equal_to_maintained_ones(checkpoint: Callable[[str], Path]) -> None:
    """Sessions under `exact` keep no digests; switching builds them from the KV, identically."""
    ckpt = checkpoint("llama_gqa4_tied")
    prompt = random_prompt(150, 512, seed=11)
    engines = [make_engine(ckpt, policy="exact"), make_engine(ckpt, policy="attention_entropy")]
    digests = []
    for e in engines:
        s = e.create_session()
        e.append(s, token_ids=prompt)
        e.set_policy(s, "attention_entropy")
        seq = e.session(s).seq
        nb = e.runner.blocks.table(seq).num_blocks
        assert e.runner.digests.layers == (2,)  # (the first two layers are dense: they keep none)
        digests.append(torch.stack([e.runner.digests.get(seq, layer, nb) for layer in e.runner.digests.layers]))
    assert torch.equal(digests[0], digests[1])


def test_rewind_restores_the_digests_of_the_kept_tokens(checkpoint: Callable[[str], Path]) -> None:
    """After a generation and a rewind to the prompt, the digests equal those of a session that
    only saw the prompt, and generating again gives the same tokens (each branch selects as if
    the others had never run)."""
    ckpt = checkpoint("llama_gqa4_tied")
    prompt = random_prompt(203, 512, seed=21)  # 202 tokens of KV: the rewind cuts inside a part
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    kw = {"window_tokens": 64, "window_min_tokens": 64, "recent_tokens": 16, "dense_layers": 1}
    engine, fresh = make_engine(ckpt, **kw), make_engine(ckpt, **kw)
    s, f = engine.create_session(), fresh.create_session()
    engine.append(s, token_ids=prompt)
    fresh.append(f, token_ids=prompt)
    first = engine.complete(s, "", params).token_ids
    engine.rewind(s, len(prompt))
    seq, fseq = engine.session(s).seq, fresh.session(f).seq
    nb = fresh.runner.blocks.table(fseq).num_blocks
    assert engine.runner.digests.layers == (1, 2)
    for layer in engine.runner.digests.layers:
        assert torch.equal(engine.runner.digests.get(seq, layer, nb), fresh.runner.digests.get(fseq, layer, nb))
    assert engine.complete(s, "", params).token_ids == first == fresh.complete(f, "", params).token_ids


def test_layerwise_probes_set_anchors_that_selection_reads(checkpoint: Callable[[str], Path]) -> None:
    """Prefill records per-layer anchors outside sinks and the recent window; decode reads them."""
    ckpt = checkpoint("llama_gqa4_tied")
    engine = make_engine(
        ckpt, policy="layerwise", window_tokens=128, window_min_tokens=128, recent_tokens=32, dense_layers=1
    )
    s = engine.create_session()
    engine.append(s, token_ids=random_prompt(600, 512, seed=5))
    state = engine.kv.selection(engine.session(s).seq)
    assert set(state.anchors) == {1, 2}  # the sparse layers
    nb = engine.runner.blocks.table(engine.session(s).seq).num_blocks
    for anchors in state.anchors.values():
        assert 0 < len(anchors) <= 128 // BS - 3  # budget minus 1 sink and 2 recent blocks
        assert not set(anchors.tolist()) & {0, nb - 2, nb - 1}
    cfg = engine.runner.hbf
    sel = state.policy.select(state, cfg, 1, torch.zeros(8, 16), torch.zeros(2, nb, 2, 16), nb, BS, 0.25)
    assert sel is not None and set(state.anchors[1].tolist()) <= set(sel.tolist())
    assert len(engine.complete(s, "", SamplingParams(max_tokens=4, ignore_eos=True)).token_ids) == 4


def _oracle_promote(
    hbm: np.ndarray, ddr: np.ndarray, uses: dict[tuple[int, int], list[int]], free: list[int], ddr_free: int,
    picks: list[tuple[int, np.ndarray]], keep: np.ndarray, limit: int, full: int, step: int,
) -> tuple[list[set[int]], int]:  # fmt: skip
    """Per layer and per block, in plain Python: HBM contents after a promotion, and evictions.
    A block's value is its count of uses decayed by 0.99 per step (`uses`: the steps it was used)."""
    for layer, sel in picks:
        for j in sel.tolist():
            uses.setdefault((layer, j), []).append(step)

    def value(layer: int, j: int) -> float:
        return sum(0.99 ** (step - s) for s in uses.get((layer, j), []))

    resident = [set(np.flatnonzero(row != NONE).tolist()) for row in hbm]
    evicted = 0
    ddr_left = ddr_free
    for layer, sel in picks:
        missing = [j for j in sel.tolist() if j not in resident[layer] and j < full]
        room = free[layer]
        if room < len(missing):
            worth = min(value(layer, j) for j in missing)
            protected = set(sel.tolist()) | set(keep.tolist())
            cands = [j for j in resident[layer] if j < limit and j not in protected]
            cands.sort(key=lambda j: (value(layer, j), hbm[layer, j]))  # lowest value, then lowest slot
            for j in cands[: len(missing) - room]:
                if value(layer, j) >= worth:
                    break
                if ddr[layer, j] == NONE:
                    if ddr_left == 0:
                        continue
                    ddr_left -= 1
                resident[layer].discard(j)
                evicted += 1
                room += 1
        resident[layer].update(missing[:room])
    return resident, evicted


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    steps=st.integers(1, 12),
    ddr_spare=st.sampled_from([0, 3, 1000]),
    rescale=st.sampled_from([4096, 2]),
)
def test_vectorized_promotion_matches_a_per_block_oracle(seed: int, steps: int, ddr_spare: int, rescale: int) -> None:
    """`TierManager.promote` (all layers at once) moves exactly what a per-layer, per-block loop
    says: same HBM contents, same eviction count, never a protected block; bookkeeping stays valid.
    `rescale` 2 scales the ranks back down every other step (`_use_weight`): the order is kept."""
    _promotion_against_oracle(seed, steps, ddr_spare, rescale)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(0, 400),
    layers=st.integers(1, 70),
    top=st.sampled_from([2**10, 2**26 - 1, 2**27]),
    descending=st.booleans(),
)
def test_the_packed_sort_by_layer_and_rank_equals_lexsort(
    seed: int, n: int, layers: int, top: int, descending: bool
) -> None:
    """`sort_by_layer_and_rank` (the promotion's victims, the fair shares' demotions and fills):
    by layer, rank ascending or descending, then tie, as `np.lexsort` orders them, with ranks
    tied (many zeros, repeated values), 64 layers or more and ties past 2**26 (both of which fall
    back to lexsort). `lowest_per_layer` (the victims) takes min(count, candidates) of each layer,
    the lowest ranks first, ties to the lowest slot."""
    from h3d.tiers.promotion import lowest_per_layer, sort_by_layer_and_rank

    rng = np.random.default_rng(seed)
    cand_layers = rng.integers(0, layers, n)
    values = rng.choice(np.array([0.0, 0.25, 7.0, 1e30], dtype=np.float32), n)
    spread = rng.random(n) < 0.3  # and some distinct ranks
    values[spread] = rng.random(int(spread.sum())).astype(np.float32)
    ties = rng.choice(top + 1, n, replace=False) if n else np.empty(0, dtype=np.int64)
    got = sort_by_layer_and_rank(cand_layers, values, ties, descending)
    order = np.lexsort((ties, -values if descending else values, cand_layers))
    np.testing.assert_array_equal(got[0], cand_layers[order])
    np.testing.assert_array_equal(got[1], ties[order])
    slow = sort_by_layer_and_rank(cand_layers, values, ties, descending, packed=False)
    for a, b in zip(got, slow, strict=True):
        np.testing.assert_array_equal(a, b)
    count = rng.integers(0, 6, layers)
    v_layers, slots = lowest_per_layer(cand_layers, values, ties, count)
    np.testing.assert_array_equal(
        np.bincount(v_layers, minlength=layers), np.minimum(count, np.bincount(cand_layers, minlength=layers))
    )
    for layer in range(layers):
        mine = cand_layers == layer
        lowest = sorted(zip(values[mine].tolist(), ties[mine].tolist(), strict=True))[: count[layer]]
        assert slots[v_layers == layer].tolist() == [slot for _, slot in lowest]


def bare_cache(layers: int, bs: int, hbm_per_layer: int, ddr: int, hkv: int = 1, promote_bytes: int | None = None):  # type: ignore[no-untyped-def]
    """A KV cache with pools one element wide (planning never reads bytes), no model, one session (1)."""
    from h3d.kv.cache import KVCache

    kv = KVCache(
        num_layers=layers, num_kv_heads=hkv, head_dim=1, dtype=torch.float32, device=torch.device("cpu"),
        hbm_regions=hbm_per_layer, ddr_slots=ddr, block_size=bs, hbf=EngineConfig().hbf,
        promote_bytes_per_step=promote_bytes,
    )  # fmt: skip
    kv.open(SeqId(1), "s")
    return kv


def _promotion_against_oracle(seed: int, steps: int, ddr_spare: int, rescale: int) -> None:
    rng = np.random.default_rng(seed)
    layers, bs, nb = 4, 4, 40
    spl = int(rng.integers(6, 16))
    kv = bare_cache(layers, bs, spl, (nb - spl) * layers + ddr_spare)  # DDR: `ddr_spare` free
    kv.promoter.rescale_steps = rescale
    blocks, tiers = kv.blocks, kv.tiers
    seq = SeqId(1)
    tokens = nb * bs - int(rng.integers(0, bs))  # maybe a partial last block
    blocks.append(seq, tokens)
    keep = np.union1d([0], np.arange(nb - 2, nb))
    uses: dict[tuple[int, int], list[int]] = {}
    for _ in range(steps):
        t = blocks.table(seq)
        picks = []
        for layer in range(layers):
            if rng.random() < 0.2:
                continue  # a dense layer: no selection
            picks.append((layer, np.union1d(keep, rng.choice(nb, int(rng.integers(1, 12)), replace=False))))
        limit = nb - int(rng.integers(0, 3))
        expect, evicted = _oracle_promote(
            t.hbm.copy(), t.ddr.copy(), uses, [a.num_free for a in blocks.hbm_alloc], blocks.ddr_free,
            picks, keep, min(limit, tokens // bs), tokens // bs, tiers.step + 1,
        )  # fmt: skip
        before = tiers.counters.hbm_evict_count
        tiers.begin_step([seq])
        keys = [sel + layer * t.capacity for layer, sel in picks]  # (layer, block) keys, some twice
        keys += [sel[: len(sel) // 2] + layer * t.capacity for layer, sel in picks]
        selected = {seq: np.concatenate(keys) if keys else np.empty(0, dtype=np.int64)}
        kv.promoter.promote(selected, {seq: limit}, {seq: keep})
        t = blocks.table(seq)
        got = [set(np.flatnonzero(row != NONE).tolist()) for row in t.hbm]
        assert got == expect
        assert tiers.counters.hbm_evict_count - before == evicted
        tiers.check()


@pytest.mark.parametrize(
    ("entropy", "expected"),
    [(0.5, [1536, 1152, 1024, 1024]), (2.0, [2048, 2048, 2048, 2048]), (3.0, [2560, 3200, 4000, 4096])],
)
def test_entropy_resizes_the_window_every_16_steps_within_its_bounds(entropy: float, expected: list[int]) -> None:
    """Below entropy_shrink_below the window shrinks by 1/4, above entropy_grow_above it grows by
    1/4, clamped to [window_min_tokens, window_max_tokens]; only every `resize_every` steps."""
    from h3d.hbf.policy import HbfConfig

    cfg = HbfConfig(
        policy="attention_entropy", window_tokens=2048, window_min_tokens=1024, window_max_tokens=4096,
        sink_blocks=1, recent_tokens=256, dense_layers=2, entropy_shrink_below=1.3, entropy_grow_above=2.5,
    )  # fmt: skip
    state = SelectionState(POLICIES["attention_entropy"], 2048)
    sizes = []
    for _ in range(4):
        for step in range(16):
            state.entropies.append(entropy)
            state.policy.after_step(state, cfg)
            if step < 15:
                assert state.entropies, "resized before 16 steps"
        assert state.entropies == []  # the mean of those 16 steps was used, then forgotten
        sizes.append(state.window_tokens)
    assert sizes == expected
    fixed = SelectionState(POLICIES["fixed"], 2048)
    for _ in range(32):
        fixed.entropies.append(0.1)
        fixed.policy.after_step(fixed, cfg)
    assert fixed.window_tokens == 2048  # only attention_entropy resizes


def test_a_resize_reads_only_the_entropies_of_steps_before_its_own() -> None:
    """The step under way's entropy (still being computed on a GPU) is not read by that step's
    resize: it opens the next period. A graph step's entropy, read back during the next step, goes
    straight into the period. Fifteen peaked steps and a spread 16th: the window shrinks, and the
    16th step's entropy is the next period's first."""
    from h3d.hbf.policy import HbfConfig, record_entropy

    cfg = HbfConfig(
        policy="attention_entropy", window_tokens=2048, window_min_tokens=1024, window_max_tokens=4096,
        sink_blocks=1, recent_tokens=256, dense_layers=2, entropy_shrink_below=1.3, entropy_grow_above=2.5,
    )  # fmt: skip
    state = SelectionState(POLICIES["attention_entropy"], 2048)
    for step in range(16):
        record_entropy(state, 100.0 if step == 15 else 0.5, current=True)
        state.policy.after_step(state, cfg)
    assert state.window_tokens == 1536  # the mean of 15 x 0.5; with the 16th it would have grown
    assert state.entropies == [100.0] and state.current_entropy is None
    lagged = SelectionState(POLICIES["attention_entropy"], 2048)
    for step in range(16):
        state.policy.after_step(lagged, cfg)
        record_entropy(lagged, 100.0 if step == 15 else 0.5, current=False)  # arrives after its step
    assert lagged.window_tokens == 1536 and lagged.entropies == [100.0]  # the same resize


def test_dense_layers_given_their_share_of_hbm_keep_their_blocks_there(checkpoint: Callable[[str], Path]) -> None:
    """With `dense_hbm_share` the dense layers' regions hold their whole context while the sparse
    layers keep only what their window needs; unset, each dense layer holds the longest context
    (`max_context_tokens`) where equal regions would not; equal regions (a third each) leave the
    dense layer's blocks in DDR. Where the blocks live changes nothing that is computed: the same
    tokens."""
    ckpt = checkpoint("llama_gqa4_tied")
    probe = make_engine(ckpt)
    layers, slot_bytes = probe.model.config.num_layers, probe.runner.hbm.slot_bytes
    prompt = random_prompt(600, 512, seed=11)  # 38 blocks of 16 tokens
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = {}
    for share in (1 / 3, None, 0.7):
        engine = make_engine(
            ckpt, block_size=BS, policy="attention_entropy", window_tokens=128, window_min_tokens=128,
            dense_layers=1, hbm_mb=30 * layers * slot_bytes / 2**20, dense_hbm_share=share, check_invariants=True,
            max_context_tokens=640,
        )  # fmt: skip
        s = engine.create_session()
        engine.append(s, token_ids=prompt)
        out = engine.complete(s, "", params)
        t = engine.runner.blocks.table(engine.sessions[s].seq)
        in_hbm = (t.hbm[:, : t.num_blocks] != NONE).sum(axis=1)  # [L] blocks per layer in HBM
        runs[share] = (out, in_hbm, engine.runner.blocks.hbm_regions.tolist())
    (equal, eq_hbm, eq_regions), (auto, au_hbm, au_regions) = runs[1 / 3], runs[None]
    dense, de_hbm, de_regions = runs[0.7]
    nb = -(-(600 + 12 - 1) // BS)
    assert layers == 3 and eq_regions == [30] * 3 and eq_hbm[0] < nb
    assert au_regions == [40, 25, 25] and au_hbm[0] == nb, "unset: the longest context (40 blocks) in HBM"
    assert de_regions == [62, 14, 14] and de_hbm[0] == nb, "the dense layer's whole context is in HBM"
    assert dense.token_ids == auto.token_ids == equal.token_ids


def test_promotions_per_step_are_capped_hottest_first() -> None:
    """With `promote_bytes_per_step` room for two blocks, a step that read five blocks from DDR
    promotes the two hottest; the others stay in DDR (read in place), and a later step goes on.
    The bytes counted as fetched are the reading heads' share of each block."""
    bs, hkv = 4, 2
    slot_bytes = 2 * bs * hkv * 1 * 4  # K and V, fp32, one element wide
    kv = bare_cache(1, bs, 8, 64, hkv, promote_bytes=2 * slot_bytes)
    blocks, tiers, hbm = kv.blocks, kv.tiers, kv.hbm
    assert hbm.slot_bytes == slot_bytes
    seq = SeqId(1)
    blocks.append(seq, 30 * bs)  # blocks 0-7 in HBM, 8-29 in DDR
    t = blocks.table(seq)
    kv.blocks.entries.hotness[t.ids[0, [12, 14]]] = [5.0, 3.0]  # read often before
    assert kv.promoter.rank(seq)[0, [12, 14]].tolist() == [5.0, 3.0]
    keys = np.array([10, 11, 12, 13, 14, 10, 12])  # two heads read 10 and 12
    tiers.begin_step([seq])
    kv.promoter.promote({seq: keys}, {seq: 30}, {seq: np.array([0, 29])})
    in_hbm = set(np.flatnonzero(blocks.table(seq).hbm[0] != NONE).tolist())
    assert {12, 14} <= in_hbm and not in_hbm & {10, 11, 13}
    c = tiers.counters
    assert c.promote_count == 2 and c.hbm_misses == 5
    assert c.fetch_bytes == 7 * hbm.slot_bytes // hkv  # seven head reads of half a block each
    tiers.begin_step([seq])
    kv.promoter.promote({seq: keys}, {seq: 30}, {seq: np.array([0, 29])})
    assert c.promote_count == 4 and c.hbm_misses == 5 + 3  # 12, 14 were hits; two more moved up
    tiers.check()


def test_anchors_are_logged_when_they_change_and_restored(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A session's token log gets its HBF anchors when a probe changes them, not at every
    request's end (a long prompt's are large); a restarted engine reads them back whole."""
    import json

    from h3d.engine.sampling import SamplingParams
    from h3d.store.tokenlog import HEADER, META, SUFFIX

    ckpt = checkpoint("llama_gqa4_tied")
    kw = {"policy": "attention_entropy", "window_tokens": 128, "window_min_tokens": 128, "window_max_tokens": 256,
          "recent_tokens": 32, "dense_layers": 1, "session_log_path": str(tmp_path / "logs")}  # fmt: skip
    engine = make_engine(ckpt, **kw)
    s = engine.create_session()
    engine.append(s, token_ids=random_prompt(600, 512, seed=5))
    for _ in range(3):  # three requests end: three metadata writes without a probe
        engine.complete(s, "", SamplingParams(max_tokens=2, ignore_eos=True))
    state = engine.kv.selection(engine.session(s).seq)
    want = {layer: a.tolist() for layer, a in state.head_anchors.items()}
    assert want and state.anchors
    engine.close()

    data = (tmp_path / "logs" / f"{s}{SUFFIX}").read_bytes()
    metas, pos = [], 0
    while pos < len(data):
        _, kind, length, _ = HEADER.unpack_from(data, pos)
        if kind == META:
            metas.append(json.loads(data[pos + HEADER.size : pos + HEADER.size + length]))
        pos += HEADER.size + length
    with_anchors = [m for m in metas if "hbf_anchors" in m]
    assert len(metas) >= 5 and len(with_anchors) == 2  # created (none yet), then the probe's
    assert with_anchors[-1]["hbf_anchors"]["head_anchors"] and all("anchors" not in m["hbf"] for m in metas)

    again = make_engine(ckpt, **kw)
    restored = again.kv.selection(again.session(s).seq)
    assert {layer: a.tolist() for layer, a in restored.head_anchors.items()} == want
    assert {k: v.tolist() for k, v in restored.anchors.items()} == {k: v.tolist() for k, v in state.anchors.items()}
    again.close()


def test_the_arena_holds_the_digests_of_the_layers_that_select_only() -> None:
    """The dense layers read every block and a sliding-window layer its window: neither keeps
    digests, and the arena holds rows for the others alone (Gemma 3 12B keeps 8 of its 48 layers'
    digests)."""
    from h3d.kv.cache import KVCache

    hbf = replace(EngineConfig().hbf, dense_layers=1)
    kv = KVCache(
        num_layers=5, num_kv_heads=2, head_dim=8, dtype=torch.float32, device=torch.device("cpu"),
        hbm_regions=64, ddr_slots=64, block_size=BS, hbf=hbf, windows=[None, 64, None, 64, None],
    )  # fmt: skip
    d = kv.digests
    assert d.layers == (2, 4) and d.shape == (2, 2)
    assert [d.keeps(layer) for layer in range(5)] == [False, False, True, False, True]
    seq = SeqId(1)
    k = torch.randn(3 * BS, 2, 8)
    for layer in d.layers:
        d.update(seq, layer, 0, k * (layer + 1))
    assert d.arena(2).shape[0] == 2 and d.nbytes() == d.row_bytes * d._extents[seq].rows
    assert d.row_bytes == 2 * 2 * 2 * 8 * 4  # two layers, two KV heads, (min, max) of 8 fp32
    got = joined(d.get(seq, 4, 3))  # [Hkv, 3, parts, 2, D]
    want = (k * 5).transpose(0, 1).unflatten(1, (3, BS // 8, 8))  # [Hkv, 3, parts, 8, D]
    assert torch.equal(got[..., 0, :], want.amin(dim=3)) and torch.equal(got[..., 1, :], want.amax(dim=3))
    for layer in (0, 1, 3):
        with pytest.raises(KeyError):
            d.arena(layer)


def test_a_request_whose_digests_the_device_cannot_hold_is_refused_before_any_step(
    checkpoint: Callable[[str], Path],
) -> None:
    """Every open session's digests stay on the device; the arena grows by allocating a larger
    one beside it. A request that would make it grow past the device's free memory is refused
    (OutOfBlocks: RESOURCE_EXHAUSTED) before its tokens are taken, and once there is room the
    session continues as a session never refused."""
    from h3d.errors import OutOfBlocks

    ckpt = checkpoint("llama_gqa4_tied")
    engine, plain = make_engine(ckpt), make_engine(ckpt)
    prompt = random_prompt(300, 512, seed=5)
    a, p = engine.create_session(), plain.create_session()
    engine.kv.digests.free_bytes = lambda: 0  # (a CPU arena has no limit: as a full GPU's)
    had = list(engine.session(a).tokens)
    with pytest.raises(OutOfBlocks, match="digests"):
        engine.append(a, token_ids=prompt)
    assert engine.session(a).tokens == had  # nothing taken
    engine.kv.digests.free_bytes = lambda: 1 << 40
    engine.append(a, token_ids=prompt)
    plain.append(p, token_ids=prompt)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert engine.complete(a, "", params).token_ids == plain.complete(p, "", params).token_ids


@pytest.mark.parametrize("archive", [True, False], ids=["snapshot", "keys"])
def test_idle_sessions_digests_are_set_aside_for_a_request_and_come_back_exact(
    checkpoint: Callable[[str], Path], tmp_path: Path, archive: bool
) -> None:
    """With the device full, a request takes the room of the least recently used idle session's
    digests (`KVCache.set_aside_digests`), never those of a session with a request, a pinned one
    or one whose rows another reads; the session set aside gets them back at its next step (from
    its snapshot, or from its keys without an archive) and both continue as sessions never set
    aside. Without the change the second append is refused."""
    from h3d.errors import OutOfBlocks

    ckpt = checkpoint("llama_gqa4_tied")
    hbf = {"policy": "attention_entropy", "window_tokens": 64, "window_min_tokens": 64, "window_max_tokens": 64,
           "recent_tokens": 16, "dense_layers": 1}  # fmt: skip
    extra = {"ssd_path": str(tmp_path / "archive")} if archive else {}
    engine, plain = make_engine(ckpt, **hbf, **extra), make_engine(ckpt, **hbf)
    kv, d = engine.kv, engine.kv.digests
    ids = {}
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for name, n in (("a", 300), ("b", 40), ("c", 20)):
        e, p = engine.create_session(), plain.create_session()
        engine.append(e, token_ids=random_prompt(n, 512, seed=n))
        plain.append(p, token_ids=random_prompt(n, 512, seed=n))
        assert engine.complete(e, "", params).token_ids == plain.complete(p, "", params).token_ids
        ids[name] = (e, p, engine.session(e).seq)
    seq = {name: x[2] for name, x in ids.items()}
    d.free_bytes = lambda: 0  # (a CPU arena has no limit: as a full GPU's)
    more = random_prompt(200, 512, seed=7)  # fits in a's rows, not in the arena's slack
    assert d.missing(-(-200 // d.part_tokens) + d.parts) > 0
    engine.set_pin(ids["a"][0], math.inf)
    with pytest.raises(OutOfBlocks, match="digests"):  # a pinned: c's rows are not enough
        engine.append(ids["b"][0], token_ids=more)
    assert kv.tiers.counters.digests_set_aside == 1 and not d.has(seq["c"])  # (c went first: the least recent)
    engine.set_pin(ids["a"][0], None)
    with pytest.raises(OutOfBlocks, match="digests"):  # a has a request
        kv.admit(seq["b"], 200, active={seq["a"]})
    engine.append(ids["b"][0], token_ids=more)
    plain.append(ids["b"][1], token_ids=more)
    assert not d.has(seq["a"]) and kv.tiers.counters.digests_set_aside == 2
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for name in ("b", "a", "c", "b"):  # each back, another set aside for it
        e, p, _ = ids[name]
        assert engine.complete(e, "", params).token_ids == plain.complete(p, "", params).token_ids, name
        assert d.has(seq[name])
    assert kv.tiers.counters.digests_set_aside >= 3
    fork = engine.session(engine.fork(ids["c"][0])).seq  # c lends its rows to its fork: never set aside
    assert d.lends(seq["c"])
    with pytest.raises(OutOfBlocks, match="digests"):
        kv.admit(seq["a"], 10_000, active={fork})
    assert d.has(seq["c"]) and d.lends(seq["c"]) and not d.has(seq["b"])
    if archive:
        assert kv.digest_files is not None and kv.digest_files.bytes_read > 0  # taken from the snapshots


def test_admission_counts_the_digests_active_sessions_take_back_at_their_next_step(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions whose digests were set aside take them back together at the step they share: a
    request admitted beside active ones whose digests are still away counts theirs too (32
    Generates on an H100 were each admitted alone, then one step brought back ten sessions'
    digests at once, could not grow the arena, and failed all 32)."""
    ckpt = checkpoint("llama_gqa4_tied")
    hbf = {"policy": "attention_entropy", "window_tokens": 64, "window_min_tokens": 64, "window_max_tokens": 64,
           "recent_tokens": 16, "dense_layers": 1}  # fmt: skip
    engine = make_engine(ckpt, **hbf, ssd_path=str(tmp_path / "archive"))
    kv, d = engine.kv, engine.kv.digests
    seqs = []
    for n in (300, 200, 100):
        sid = engine.create_session()
        engine.append(sid, token_ids=random_prompt(n, 512, seed=n))
        seqs.append(engine.session(sid).seq)
    a, b, c = seqs
    kv.set_aside_digests(a)
    kv.set_aside_digests(b)
    asked: list[int] = []
    missing = d.missing
    monkeypatch.setattr(d, "missing", lambda parts: asked.append(parts) or missing(parts))
    d.free_bytes = lambda: 1 << 40
    kv.admit(b, 8)  # alone: its own return and growth
    kv.admit(b, 8, active={a, c})  # beside a, whose digests are away too, and c, whose are here
    back = {s: -(-kv.sessions[s].table.num_tokens // d.part_tokens) for s in (a, b)}
    assert asked[1] - asked[0] == back[a]


def test_an_arena_that_cannot_grow_keeps_every_extent_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device out of memory while the arena grows: OutOfBlocks, and every session's digests
    where they were (the one growing too)."""
    from h3d.errors import OutOfBlocks

    store = DigestStore(2, 2, 8, BS, torch.float32, torch.device("cpu"), 8)
    g = torch.Generator().manual_seed(0)
    keys = {SeqId(i): torch.randn(40 * (i + 1), 2, 8, generator=g) for i in range(3)}
    for seq, k in keys.items():
        for layer in (0, 1):
            store.update(seq, layer, 0, k)
    before = {seq: joined(store.get(seq, 1, -(-len(k) // BS))).clone() for seq, k in keys.items()}

    def no_memory(rows: int) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (a test's)")

    monkeypatch.setattr(store, "_empty", no_memory)
    with pytest.raises(OutOfBlocks, match="digests"):
        store.ensure(SeqId(0), store.rows)  # more than the whole arena: it must grow
    for seq, k in keys.items():
        assert torch.equal(joined(store.get(seq, 1, -(-len(k) // BS))), before[seq]), seq
