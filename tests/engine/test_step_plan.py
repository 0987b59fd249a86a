"""The step as values: the planner fed the scheduler's output, checked as data (no forward runs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path as FsPath

import numpy as np
import pytest

from h3d.engine.graphs import GraphKey, batch_bucket, room_bucket, width_bucket
from h3d.engine.step import Path, StepPlan
from h3d.hbf.policy import base_sizes
from h3d.kv.attention import kernel_attention
from tests.helpers import VOCAB_SIZE, make_engine, random_prompt

MODEL = "llama_gqa4_tied"
BS = 16


def _engine(checkpoint: Callable[[str], FsPath], tmp_path: FsPath):  # type: ignore[no-untyped-def]
    """Three sessions: `decoding` (400 tokens under attention_entropy, past its 192-token window),
    `exact` (300 tokens under exact) and `fresh` (empty), each with a request in flight: the two
    first generate (one decode token each this step: an append leaves its last token to the
    generation), the last appends a 90-token prompt (89 of them fed: its last waits likewise)."""
    engine = make_engine(
        checkpoint(MODEL), policy="attention_entropy", window_tokens=192, window_min_tokens=64, window_max_tokens=256,
        recent_tokens=32, dense_layers=1, ssd_path=str(tmp_path / "archive"), prefill_chunk_tokens=128,
    )  # fmt: skip
    decoding, exact, fresh = engine.create_session(), engine.create_session(policy="exact"), engine.create_session()
    engine.append(decoding, token_ids=random_prompt(400, VOCAB_SIZE, seed=1))
    engine.append(exact, token_ids=random_prompt(300, VOCAB_SIZE, seed=2))
    for sid in (decoding, exact):
        engine.submit(sid, generate=True, params=engine.with_sampling(max_tokens=4, ignore_eos=True))
    engine.submit(fresh, token_ids=random_prompt(90, VOCAB_SIZE, seed=3), generate=False)
    return engine, [engine.session(s).seq for s in (decoding, exact, fresh)]


def _rows_of(plan: StepPlan, engine, i: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Chunk i's rows as its table places its tokens now: slot * block_size + offset, >= 0 in
    HBM, -(DDR row + 1) in DDR."""
    c = plan.chunks[i]
    t = engine.runner.blocks.table(c.seq)
    pos = np.arange(c.start, c.start + len(c.token_ids))
    loc = t.all_locations()[:, pos // BS]  # [L, n]
    return np.where(loc >= 0, loc * BS + pos % BS, -((-loc - 1) * BS + pos % BS) - 1)


def test_the_planner_gives_allocations_selections_and_the_host_path(
    checkpoint: Callable[[str], FsPath], tmp_path: FsPath
) -> None:
    """Decode tokens first (the HBF one selects, the exact one does not), then the prompt's
    chunk (probed: it ends what its session was given); the tokens appended to their tables
    with the rows their blocks hold; nothing in the archive only: no staging; on the CPU
    without the device's paths, the host carries the step out."""
    engine, (decoding, exact, fresh) = _engine(checkpoint, tmp_path)
    out = engine.schedule()
    assert [c.seq for c in out.chunks] == [decoding, exact, fresh]
    assert [len(c.token_ids) for c in out.chunks] == [1, 1, 89] and all(c.final for c in out.chunks)
    plan = engine.runner.plan(out.chunks)
    assert plan.path is Path.HOST and plan.locations is None and plan.graph is None
    assert plan.selects == (True, False, False) and plan.probes == (False, False, True) and not plan.staging
    assert plan.rows.shape == (3, 91)  # [L, N]
    for i, c in enumerate(plan.chunks):
        assert engine.kv.cached_tokens(c.seq) == c.start + len(c.token_ids)  # allocated
        at = sum(len(x.token_ids) for x in plan.chunks[:i])
        np.testing.assert_array_equal(plan.rows[:, at : at + len(c.token_ids)], _rows_of(plan, engine, i))
    assert plan.protect == {decoding: 399 // BS, exact: 299 // BS, fresh: 0}
    engine.close()


def test_the_planner_picks_the_device_or_a_graph_and_stages_archived_blocks_on_the_host(
    checkpoint: Callable[[str], FsPath], tmp_path: FsPath
) -> None:
    """A decode step goes to the device (its plan carries every layer's locations) or, with
    graphs on, to the graph of its shape (batch, width, the capacity of the widest window,
    mixed); a session whose blocks are in the archive only keeps the step on the host, which
    stages them."""
    engine, (decoding, exact, _) = _engine(checkpoint, tmp_path)
    runner = engine.runner
    runner.plan_on_device = True
    decode = engine.schedule().chunks[:2]
    plan = runner.plan(decode)
    assert plan.path is Path.DEVICE and plan.locations is not None
    for i, seq in enumerate((decoding, exact)):
        t = runner.blocks.table(seq)
        np.testing.assert_array_equal(plan.locations[:, i, : t.num_blocks], t.all_locations())
        assert not plan.locations[:, i, t.num_blocks :].any()  # 0 pads
    runner._undo(plan.chunks)  # the step not run: the caches end where the chunks started

    engine.model.use_attention(kernel_attention)
    runner.graphs.enabled = True
    plan = runner.plan(decode)
    sinks, recent = base_sizes(runner.hbf, BS)
    nb = {s: -(-engine.kv.cached_tokens(s) // BS) for s in (decoding, exact)}
    capacity = room_bucket(256 // BS - sinks - recent)  # the widest window's room, whatever the window now
    assert runner.graphs.capacity == capacity
    assert plan.graph == GraphKey(batch_bucket(2), width_bucket(max(nb.values())), capacity, mixed=True)
    assert plan.path is Path.GRAPH
    runner._undo(plan.chunks)

    engine.kv.demote(decoding, to_ssd=True)  # its blocks in the archive only
    plan = runner.plan(decode)
    assert plan.staging and plan.path is Path.HOST
    runner._undo(plan.chunks)
    engine.close()


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_planned_step_reports_its_reads_and_picks_and_the_commit_counts_them(
    checkpoint: Callable[[str], FsPath], tmp_path: FsPath, path: str
) -> None:
    """Nothing is counted during the forward: the report carries the whole-table reads (the
    exact session's every layer, the HBF session's dense one) and the HBF session's picks (its
    sparse layers, one key per KV head); its commit adds them to the tier counters."""
    engine, (decoding, exact, _) = _engine(checkpoint, tmp_path)
    runner = engine.runner
    runner.plan_on_device = path == "device"
    before = engine.tier_stats()
    report = runner.execute(runner.plan(engine.schedule().chunks[:2]))
    assert report.plan.path is (Path.DEVICE if path == "device" else Path.HOST)
    # nothing counted yet (the dirty bytes are a gauge: the plan made the step's new blocks; so is
    # the archive's use, which keeps room for the digest snapshots of the sessions' full blocks)
    gauges = {"dirty_bytes": 0, "ssd_used_bytes": 0}
    assert replace(engine.tier_stats(), **gauges) == replace(before, **gauges)
    nb = {s: -(-engine.kv.cached_tokens(s) // BS) for s in (decoding, exact)}
    read: dict = {}
    for r in report.reads:  # (the host path reports each layer's reads, the device each session's)
        read[r.seq] = read.get(r.seq, 0) + r.total
    assert read == {decoding: nb[decoding], exact: 3 * nb[exact]}
    keys = report.picks[decoding]
    layers = keys // runner.blocks.table(decoding).capacity
    assert set(layers.tolist()) == {1, 2} and exact not in report.picks  # the sparse layers only
    runner.commit(report)
    after = engine.tier_stats()
    whole = sum(r.total for r in report.reads)
    assert after.hbm_hits + after.hbm_misses - before.hbm_hits - before.hbm_misses > whole  # + the picks
    engine.close()


def test_the_prompt_probe_skips_sliding_window_layers(checkpoint: Callable[[str], FsPath]) -> None:
    """HBF's prompt probe (anchors, a gather of every earlier key) runs in the global layers only: a
    sliding layer reads its window whatever the policy, so anchors there would be read for nothing."""
    engine = make_engine(checkpoint("gemma3_window"), policy="layerwise", dense_layers=0)
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(300, 512, seed=3))
    state = engine.runner.kv.selection(engine.session(sid).seq)
    assert set(state.anchors) == {2} and set(state.head_anchors) == {2}  # layers 0 and 1 slide
    engine.close()
