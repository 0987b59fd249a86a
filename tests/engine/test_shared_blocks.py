"""Shared blocks: a fork and a reused prefix point at their parent's KV blocks rather than copying
them (`BlockManager.share`). The blocks are held once in HBM and DDR, reference-counted; no block
is freed while a session points at it, none is left behind once none does, and every session
decodes exactly as an unshared one given its tokens would, through random sequences of forks,
decodes, rewinds, demotions, closes, deletes and restarts."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import VOCAB_SIZE, make_engine, random_prompt

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId
from h3d.kv.slots import FREE

BS = 16
LAYERS = 3  # llama_gqa4_tied
MODEL = "llama_gqa4_tied"


def _engine(checkpoint: Callable[[str], Path], tmp_path: Path, **kw: Any) -> Engine:
    return make_engine(
        checkpoint(MODEL), prefill_chunk_tokens=64, ssd_path=str(tmp_path / "ssd"),
        session_log_path=str(tmp_path / "logs"), **kw,
    )  # fmt: skip


def _used(engine: Engine) -> int:
    """Block copies held in HBM and DDR, all sessions together (each slot once)."""
    b = engine.kv.blocks
    return b.hbm_capacity - int(b.hbm_alloc.free.sum()) + b.ddr_alloc.capacity - b.ddr_free


def test_forks_hold_the_parents_blocks_once(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    engine = _engine(checkpoint, tmp_path, hbm_mb=64.0)
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(600, VOCAB_SIZE, seed=3))
    one = _used(engine)
    shared = (600 - 1) // BS  # a whole fork shares every full block
    forks = [engine.fork(parent) for _ in range(4)]
    tail = -(-600 // BS) - shared  # each fork's own blocks: the partial last one, copied
    assert _used(engine) - one <= 4 * tail * LAYERS  # (with HBM room, one copy each)
    b = engine.kv.blocks
    ids = b.table(engine.session(parent).seq).ids[:, :shared]
    assert (b.entries.refs[ids] == 5).all()
    assert b.peers(engine.session(parent).seq) == {engine.session(f).seq for f in forks}
    stats, e = engine.tier_stats(), b.entries
    assert stats.shared_blocks == shared * LAYERS
    block = engine.kv.tiers.block_bytes
    assert stats.shared_hbm_saved_bytes == 4 * int((e.hbm[ids] >= 0).sum()) * block > 0
    assert stats.shared_ddr_saved_bytes == 4 * int((e.ddr[ids] >= 0).sum()) * block
    # Fair HBM counts a shared block once over the sessions sharing it (each its part of it).
    seqs = [engine.session(x).seq for x in (parent, *forks)]
    held = sum(engine.kv.shares.held(q) for q in seqs)
    in_hbm = b.hbm_capacity - int(b.hbm_alloc.free.sum())
    assert abs(int(held.sum()) - in_hbm) <= len(seqs) * LAYERS  # (each session's part rounded)
    want = engine.complete(forks[0], "", SamplingParams(max_tokens=8, ignore_eos=True)).token_ids
    for f in forks[1:]:
        assert engine.complete(f, "", SamplingParams(max_tokens=8, ignore_eos=True)).token_ids == want
    for f in forks:
        engine.close_session(f, purge=True)
    assert (b.entries.refs[ids] == 1).all() and not b.peers(engine.session(parent).seq)
    engine.close()


def _continuation(engine: Engine, sid: SessionId) -> tuple[int, ...]:
    return engine.complete(sid, "", SamplingParams(max_tokens=4, ignore_eos=True)).token_ids


def _reference(engine: Engine, tokens: list[int], n: int) -> tuple[int, ...]:
    """The greedy continuation of a session computed alone (an owner of its own: nothing shared)."""
    sid = engine.create_session(owner="alone")
    engine.append(sid, token_ids=tokens)
    out = engine.complete(sid, "", SamplingParams(max_tokens=n, ignore_eos=True)).token_ids
    engine.close_session(sid, purge=True)
    return out


def _check(engine: Engine) -> None:
    """The bookkeeping (no block freed while pointed at: counts equal the cells pointing), every
    pair of copies of a block equal, and each archived block's record under its home's name."""
    engine.kv.check()
    archive, b = engine.kv.tiers.archive, engine.kv.blocks
    if archive is None:
        return
    for seq, t in b.tables().items():
        ids = t.ids[:, : t.num_blocks]
        mine = b.entries.archived[ids] & (b.entries.home[ids] == seq)
        held = archive.blocks_of(engine.kv.sessions[seq].name)
        assert all((layer, j) in held for layer, j in zip(*np.nonzero(mine), strict=True)), seq


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_forks_closes_evictions_rewinds_and_restarts(
    checkpoint: Callable[[str], Path], tmp_path: Path, seed: int
) -> None:
    """Small HBM and DDR (most blocks in DDR and in the archive), random operations on a family of
    forks; after each the bookkeeping is checked, at the end each session decodes as one computed
    alone would, and once all are deleted no entry or slot is left in use."""
    rng = random.Random(seed)
    probe = _engine(checkpoint, tmp_path / "probe")
    slot = probe.kv.tiers.block_bytes  # one block of one layer
    probe.close()
    kw: dict[str, Any] = {"hbm_mb": 40 * LAYERS * slot / 2**20, "ddr_mb": 60 * LAYERS * slot / 2**20}
    engine = _engine(checkpoint, tmp_path, **kw)
    root = engine.create_session()
    engine.append(root, token_ids=random_prompt(500, VOCAB_SIZE, seed=seed))
    live: list[SessionId] = [root]
    seen = {"shared": 0, "ddr_only": 0, "archive_only": 0, "ops": 0}
    ops = ["fork"] * 4 + ["decode"] * 2 + ["rewind", "demote", "demote", "close", "delete", "restart"]
    for _ in range(32):
        op = rng.choice(ops)
        sid = rng.choice(live)
        if op == "fork":
            n = len(engine.session(sid).tokens)
            at = rng.choice([None, rng.randrange(max(1, n // 2), n + 1), rng.randrange(1, n + 1)])
            live.append(engine.fork(sid, at))
        elif op == "decode":
            engine.complete(sid, "", SamplingParams(max_tokens=rng.randrange(1, 20), ignore_eos=True))
        elif op == "rewind":
            engine.rewind(sid, rng.randrange(1, len(engine.session(sid).tokens) + 1))
        elif op == "demote":
            seq = engine.session(sid).seq
            engine.kv.demote(seq, to_ssd=rng.random() < 0.5)
        elif op == "close":
            engine.close_session(sid)
        elif op == "delete" and len(live) > 1:
            engine.close_session(sid, purge=True)
            live.remove(sid)
        elif op == "restart":
            if rng.random() < 0.75:
                engine.checkpoint()  # (a SIGTERM's; else as after a crash: computed again from the logs)
            engine.close()
            engine = _engine(checkpoint, tmp_path, **kw)
        _check(engine)
        e = engine.kv.blocks.entries
        used = e.refs > 0
        seen["ops"] += 1
        seen["shared"] += int((e.refs > 1).sum())
        seen["ddr_only"] += int((used & (e.hbm < 0) & (e.ddr >= 0)).sum())
        seen["archive_only"] += int((used & (e.hbm < 0) & (e.ddr < 0)).sum())
    assert seen["shared"] and seen["ddr_only"] and seen["archive_only"], seen  # (each state was reached)
    for sid in live:
        tokens = list(engine.session(sid).tokens)
        assert _continuation(engine, sid) == _reference(engine, tokens, 4), f"session {sid} (seed {seed})"
        _check(engine)
    for sid in live:
        engine.close_session(sid, purge=True)
    b = engine.kv.blocks
    assert b.entries.num_used == 0 and not b.tables()
    assert (b.hbm_owner[1:] == FREE).all() and (b.ddr_owner[1:] == FREE).all()
    assert np.count_nonzero(b.entries.refs) == 0
    engine.close()


def test_ddr_full_of_shared_blocks_makes_idle_sharers_compute_again(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A shared block stays where it is; when DDR is full and shared blocks hold most of it, a
    session that needs DDR gets it: the idle sessions that share those blocks forget their KV
    from the first shared one in DDR (their tokens stay) and compute it again when used, with
    the same tokens."""
    probe = _engine(checkpoint, tmp_path / "probe")
    slot = probe.kv.tiers.block_bytes
    probe.close()
    engine = _engine(checkpoint, tmp_path, hbm_mb=4 * LAYERS * slot / 2**20, ddr_mb=80 * slot / 2**20)
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(300, VOCAB_SIZE, seed=21))
    fork = engine.fork(parent)
    b = engine.kv.blocks
    assert int((b.shared(np.arange(b.entries.capacity)) & (b.entries.ddr >= 0)).sum()) >= 30
    engine.kv.take_notices()
    other = engine.create_session(owner="other")
    engine.append(other, token_ids=random_prompt(800, VOCAB_SIZE, seed=22))  # a layer of it takes most of DDR
    dropped = [d for kind, d in engine.kv.take_notices() if kind == "kv_dropped_for_recompute"]
    assert dropped and engine.cached_tokens(other) == 799
    _check(engine)
    for sid in (parent, fork):
        tokens = list(engine.session(sid).tokens)
        assert _continuation(engine, sid) == _reference(engine, tokens, 4)
    engine.close()


def test_a_rewind_inside_a_shared_block_near_a_window_floor(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A cut inside a shared block keeps the whole blocks before it, never less than what a
    sliding-window layer can keep: the cut is rounded down first, then checked against the
    freed blocks (all of the KV dropped where they would be read)."""
    engine = make_engine(
        checkpoint("qwen2_window_layers"), prefill_chunk_tokens=64, window_keep_tokens=128,
        session_log_path=str(tmp_path / "logs"),
    )  # fmt: skip
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(400, VOCAB_SIZE, seed=31))
    tokens = list(engine.session(parent).tokens)
    # The fork shares 20 blocks; its window layers keep blocks from 15 on (128 tokens past a
    # 24-token window at 400): a cut at 263-271 tokens is keepable, the block boundary below not.
    for at in range(256, 330, 2):
        fork = engine.fork(parent)
        engine.rewind(fork, at)
        kept = engine.cached_tokens(fork)
        assert kept <= at - 1 and (kept == 0 or kept % BS == 0 or kept == at - 1), (at, kept)
        _check(engine)
        if at % 20 == 0:
            assert _continuation(engine, fork) == _reference(engine, tokens[:at], 4), at
        engine.close_session(fork, purge=True)
    engine.close()


def test_without_an_archive_forks_are_admitted_by_the_blocks_they_add(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """With no archive, admission counts the blocks held: a shared one once, not once per session."""
    probe = _engine(checkpoint, tmp_path / "probe")
    slot = probe.kv.tiers.block_bytes
    probe.close()
    engine = make_engine(checkpoint(MODEL), prefill_chunk_tokens=64, hbm_mb=40 * LAYERS * slot / 2**20,
                         ddr_mb=60 * slot / 2**20)  # fmt: skip
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(400, VOCAB_SIZE, seed=41))  # 25 blocks a layer
    forks = [engine.fork(parent) for _ in range(4)]  # 5 x 25 x 3 blocks pointed at: more than 180
    assert engine.kv.blocks.entries.num_used <= 75 + 4 * 5 * LAYERS
    got = [_continuation(engine, f) for f in forks]
    for f in forks:
        engine.close_session(f, purge=True)
    assert got == [_reference(engine, list(engine.session(parent).tokens), 4)] * 4
    engine.close()


def test_a_restart_rebuilds_the_sharing_as_sessions_are_used(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """After a restart every session's KV is in the archive only, under its own records; the first
    fork used reads its blocks back, the next ones take its blocks in DDR for their own instead of
    reading theirs (`KVCache.rebase`), and decode as sessions computed alone would."""
    engine = _engine(checkpoint, tmp_path)
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(300, VOCAB_SIZE, seed=51))
    forks = [engine.fork(parent) for _ in range(3)]
    tokens = list(engine.session(parent).tokens)
    engine.checkpoint()  # (what a SIGTERM does): each session's blocks under its own name
    engine.close()
    again = _engine(checkpoint, tmp_path)
    while again.read_ahead():  # the start's read-ahead: the parent's own records, not the forks' links to them
        time.sleep(0.005)
    b = again.kv.blocks
    assert all(again.cached_tokens(s) == 299 for s in [parent, *forks])
    want = _reference(again, tokens, 4)
    reads = again.tier_stats().ssd_read_count
    got = [_continuation(again, f) for f in forks]
    assert got == [want] * 3
    seqs = [again.session(f).seq for f in forks]
    assert b.peers(seqs[0]) >= set(seqs[1:])  # the later forks share the first one's blocks
    shared = (300 - 1) // BS  # a fork's tokens are the parent's 300: all its full blocks
    assert (b.entries.refs[b.table(seqs[2]).ids[:, :shared]] >= 3).all()
    assert again.counters.prefix_hits >= 2
    # Blocks read back from the archive: the first fork's (and each one's partial last block), not three times over.
    assert again.tier_stats().ssd_read_count - reads < 2 * -(-300 // BS) * LAYERS
    _check(again)
    again.close()


def test_shared_blocks_are_written_behind_once(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Write-behind writes a block several sessions share once, under the name of the session that
    reached it (its home); after a crash (no checkpoint) the sessions come back from the records
    there are, computing the rest again, with the same tokens."""
    engine = _engine(checkpoint, tmp_path)  # (the default budget: the parent's blocks left dirty)
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(300, VOCAB_SIZE, seed=61))
    forks = [engine.fork(parent) for _ in range(2)]
    assert not engine.kv.blocks.entries.archived.any()
    engine.kv.tiers.behind.dirty_limit = 0  # (as write_behind_dirty_mb = 0: everything written behind)
    for f in forks:
        engine.complete(f, "", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.kv.tiers.behind.release()  # (the hold it made way for the prompts with: over)
    while engine.write_behind():  # (as the daemon's engine thread does once requests are done)
        engine.kv.tiers.settle()
    b, e = engine.kv.blocks, engine.kv.blocks.entries
    seqs = {engine.session(s).seq for s in (parent, *forks)}
    ids = b.table(engine.session(parent).seq).ids[:, : (300 - 1) // BS]
    assert (e.refs[ids] == 3).all() and e.archived[ids].all() and set(e.home[ids].ravel().tolist()) <= seqs
    tokens = {s: list(engine.session(s).tokens) for s in (parent, *forks)}
    engine.close()  # no checkpoint: as after a crash
    again = _engine(checkpoint, tmp_path, write_behind_dirty_mb=0)
    for s, toks in tokens.items():
        assert _continuation(again, s) == _reference(again, toks, 4), s
    again.close()


def test_the_archive_holds_a_shared_prefix_once(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A checkpoint of a parent and its forks writes the shared blocks once: each fork's records
    of them are links to the parent's (`Archive.link`), its own blocks written. Deleting the
    parent hands its records of what the forks keep over to one of them (linked, nothing written);
    after a restart each fork comes back from its own records and decodes as one computed alone."""
    engine = _engine(checkpoint, tmp_path)
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(300, VOCAB_SIZE, seed=71))
    engine.kv.snapshot(engine.session(parent).seq)
    archive = engine.kv.tiers.archive
    assert archive is not None
    one = archive.live_bytes()
    forks = [engine.fork(parent) for _ in range(3)]
    for f in forks:
        engine.complete(f, "", SamplingParams(max_tokens=20, ignore_eos=True))
    b, e = engine.kv.blocks, engine.kv.blocks.entries
    shared = (300 - 1) // BS
    ids = b.table(engine.session(parent).seq).ids[:, :shared].copy()
    assert (e.refs[ids] == 4).all() and e.archived[ids].all()
    parent_name = engine.kv.sessions[engine.session(parent).seq].name
    engine.close_session(parent, purge=True)  # its records of the shared blocks: handed over
    first = engine.session(forks[0]).seq
    assert e.archived[ids].all() and (e.home[ids] == first).all()
    name = {f: engine.kv.sessions[engine.session(f).seq].name for f in forks}
    assert archive.blocks_of(name[forks[0]]) == {(layer, j): BS for layer in range(LAYERS) for j in range(shared)}
    assert not archive.blocks_of(parent_name)  # (its partial last block, shared by none, gone)
    assert 0.7 * one < archive.live_bytes()
    written = archive.stats().records
    engine.checkpoint()
    own = -(-(300 + 20) // BS) - shared  # each fork's blocks beyond the shared ones
    assert archive.stats().records - written == 3 * own * LAYERS  # nothing shared written again
    for f in forks:
        assert len(archive.blocks_of(name[f])) == -(-(300 + 20) // BS) * LAYERS
    tokens = {f: list(engine.session(f).tokens) for f in forks}
    _check(engine)
    engine.close()
    again = _engine(checkpoint, tmp_path)
    assert all(again.cached_tokens(f) == 319 for f in forks)
    for f in forks:
        assert _continuation(again, f) == _reference(again, tokens[f], 4), f
    _check(again)
    again.close()


def test_the_dirty_budget_counts_a_shared_block_once(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Write-behind's budget (`write_behind_dirty_mb`) and the dirty bytes it reports count a block
    several sessions share once: forks of a parent whose KV fits the budget write nothing behind."""
    probe = _engine(checkpoint, tmp_path / "probe")
    block = probe.kv.tiers.block_bytes
    probe.close()
    parent_blocks = (300 // BS) * LAYERS  # its full blocks, all dirty
    engine = _engine(checkpoint, tmp_path, write_behind_dirty_mb=2 * parent_blocks * block / 2**20)
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(300, VOCAB_SIZE, seed=81))
    forks = [engine.fork(parent) for _ in range(4)]  # counted per session: 5 x the parent's, past the budget
    for f in forks:
        engine.complete(f, "", SamplingParams(max_tokens=4, ignore_eos=True))
    engine.kv.tiers.settle()
    assert engine.kv.tiers.behind.written_blocks == 0
    dirty = engine.kv.tiers.behind.stats().dirty_bytes // block
    own = (-(-304 // BS) - (300 - 1) // BS) * LAYERS  # each fork's full blocks past the shared
    assert parent_blocks <= dirty <= parent_blocks + 4 * own
    engine.close()
