"""Warm before ready (h3d.engine.warmup, DecodeGraphs.warm_set / warm / capture_deferred) on the
CPU twin: the named set "captured" (made, its forward run from padding inputs), counted, kept;
a step outside it runs its graph's forward uncaptured and its graph is captured between steps; and
graphs made from padding replay real steps as the eager path computes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path as FsPath

import numpy as np
import pytest
import torch

from h3d.daemon.convert import graph_stats_pb
from h3d.engine import warmup
from h3d.engine.graphs import MAX_GRAPHS, GraphKey, room_bucket, width_bucket
from h3d.engine.session import TokenDelta
from h3d.engine.step import Path
from h3d.hbf.policy import base_sizes
from h3d.kv.attention import kernel_attention
from tests.helpers import VOCAB_SIZE, make_engine, random_prompt

MODEL = "llama_gqa4_tied"
BS = 16
HBF = dict(window_tokens=192, window_min_tokens=64, window_max_tokens=256, recent_tokens=32, dense_layers=1)


def _engine(checkpoint: Callable[[str], FsPath], graphs: bool, context: int = 1024, **kw):  # type: ignore[no-untyped-def]
    engine = make_engine(checkpoint(MODEL), policy="attention_entropy", max_context_tokens=context, **HBF, **kw)
    if graphs:
        engine.model.use_attention(kernel_attention)
    engine.runner.graphs.enabled = graphs  # (on a GPU, H3D_TEST_DEVICE=cuda, they are on by default)
    return engine


def test_the_warm_set_is_one_session_at_every_width_exact_and_selecting(checkpoint: Callable[[str], FsPath]) -> None:
    engine = _engine(checkpoint, graphs=True)
    g = engine.runner.graphs
    keys = g.warm_set(4096)  # 256 blocks of 16 tokens
    widths = [16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256]
    assert widths == sorted({width_bucket(n) for n in range(1, 257)})
    sinks, recent = base_sizes(engine.runner.hbf, BS)
    assert g.capacity == room_bucket(256 // BS - sinks - recent) == 16  # the widest window's room
    assert keys == [GraphKey(1, w) for w in widths] + [GraphKey(1, w, 16) for w in widths if w > 64 // BS]
    assert len(keys) > MAX_GRAPHS  # more than the least-recently-used cap keeps
    engine.close()
    off = _engine(checkpoint, graphs=False)
    assert off.runner.graphs.warm_set(4096) == []  # graphs off (a CPU by default): nothing to capture
    off.close()


def test_warm_captures_the_set_keeps_it_and_leaves_no_trace_of_its_scratch_sequence(
    checkpoint: Callable[[str], FsPath], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(warmup, "BATCHES", (3,))  # one scratch batch: the path, at a CPU's cost
    engine = _engine(checkpoint, graphs=True, context=1024, prefill_chunk_tokens=128)  # 64 blocks: 18 graphs
    g = engine.runner.graphs
    forks: list[int] = []
    fork_whole = engine.kv.fork_whole
    monkeypatch.setattr(
        engine.kv, "fork_whole", lambda parent, child: forks.append(fork_whole(parent, child)) or forks[-1]
    )
    prompts: list[int] = []  # tokens of every prompt the warm-up computed
    step = engine.runner.step
    monkeypatch.setattr(
        engine.runner,
        "step",
        lambda chunks: prompts.extend(len(c.token_ids) for c in chunks if len(c.token_ids) > 1) or step(chunks),
    )
    warm = engine.warm(kernels=True)
    # the batch's third sequence is a twin of the first (its prompt shared, not computed), per policy
    assert forks == [128, 128]
    assert prompts == [128, 128] + [128, 128] * 2  # the scratch prompt twice, then 2 of 3 per policy
    keys = g.warm_set(engine.max_context)
    assert warm.prompt_tokens == 128  # the scratch prompt, within the prefill chunk
    assert warm.graphs == len(keys) and g.warm_keys == frozenset(keys)
    assert g.built > len(keys)  # and the scratch batch's own graphs
    assert warm.batches == (1,) and warm.widths == (16, 64)
    assert all(k in g._graphs for k in keys)  # none dropped while the others were made
    assert g.deferring and not g.deferred and g.captures_after_ready == 0
    stats = engine.tier_stats()
    assert not engine.kv.sessions and stats.hbm_used_bytes == stats.ddr_used_bytes == 0  # the scratch sequence is gone
    fields = warm.fields()
    assert fields["graphs"] == len(keys) == 18 and fields["graph_widths"] == [16, 64]
    assert all(fields[k] >= 0 for k in ("scratch_s", "prefill_s", "batches_s"))
    engine.close()


def test_after_warm_a_step_outside_the_set_runs_uncaptured_and_its_graph_is_captured_between_steps(
    checkpoint: Callable[[str], FsPath],
) -> None:
    engine = _engine(checkpoint, graphs=True)
    runner, g = engine.runner, engine.runner.graphs
    engine.warm(kernels=False)
    built = g.built
    a, b = engine.create_session(policy="exact"), engine.create_session(policy="exact")
    for sid, seed in ((a, 1), (b, 2)):
        engine.append(sid, token_ids=random_prompt(300, VOCAB_SIZE, seed=seed))
        engine.submit(sid, generate=True, params=engine.with_sampling(max_tokens=3, ignore_eos=True))
    two = engine.schedule().chunks
    plan = runner.plan(two)  # batch 2: outside the warm set: its graph's forward, uncaptured
    key = GraphKey(2, width_bucket(300 // BS + 1))
    assert plan.path is Path.GRAPH and plan.graph == key
    assert dict(g.deferred) == {key: 1} and g.eager_steps == 1
    runner._undo(plan.chunks)
    plan = runner.plan(two[:1])  # batch 1: in the set
    assert plan.path is Path.GRAPH and plan.graph == GraphKey(1, key.width)
    runner._undo(plan.chunks)
    engine.upkeep(idle=False)  # busy: a graph that waited one step waits on
    assert g.deferred and g.captures_after_ready == 0
    engine.upkeep(idle=True)  # idle: captured
    assert not g.deferred and g.captures_after_ready == 1 and engine.captured == [key]
    assert g.built == built + 1
    plan = runner.plan(two)
    assert plan.path is Path.GRAPH and plan.graph == key
    runner._undo(plan.chunks)
    engine.close()


def test_a_batch_whose_graph_waits_decodes_through_it_uncaptured_as_the_eager_path_does(
    checkpoint: Callable[[str], FsPath], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After warm, two sessions decoding together (batch 2: outside the warm set) run their graph's
    forward uncaptured while it waits to be captured (here it never is: nothing idles, and the
    CPU's "capture" is withheld): counted as such, not as replays, their greedy tokens an engine's
    without graphs, every step selecting past the 192-token window."""
    prompts = [random_prompt(300, VOCAB_SIZE, seed=s) for s in (1, 2)]
    out = []
    for graphs in (True, False):
        engine = _engine(checkpoint, graphs=graphs)
        g = engine.runner.graphs
        if graphs:
            engine.warm(kernels=False)
            monkeypatch.setattr(g, "_current", lambda key, g=g: key in g.warm_keys)  # (a CPU "captures" as it makes)
        sids = [engine.create_session() for _ in prompts]
        for sid, ids in zip(sids, prompts, strict=True):
            engine.append(sid, token_ids=ids)
        params = engine.with_sampling(max_tokens=8, ignore_eos=True)
        rids = {engine.submit(sid, generate=True, params=params): i for i, sid in enumerate(sids)}
        tokens: list[list[int]] = [[], []]
        paths: list[Path] = []
        plan = engine.runner.plan
        monkeypatch.setattr(
            engine.runner, "plan", lambda chunks, plan=plan, paths=paths: paths.append((p := plan(chunks)).path) or p
        )
        while engine.has_work:  # (no upkeep: nothing captured between steps)
            for event in engine.step():
                if isinstance(event, TokenDelta) and event.request_id in rids:
                    tokens[rids[event.request_id]].append(event.token_id)
        out.append((tokens, g.replays, g.eager_steps, dict(g.deferred), paths))
        engine.close()
    (tokens, replays, waited, deferred, paths), (e_tokens, *_) = out
    assert tokens == e_tokens and all(len(t) == 8 for t in tokens)
    assert replays == 0 and waited >= 7 and paths.count(Path.GRAPH) == waited  # every batched step, uncaptured
    assert list(deferred) == [GraphKey(2, width_bucket(300 // BS + 1), 16)] and deferred[next(iter(deferred))] == waited


def test_sessions_joining_a_batch_find_its_graph_captured_before_their_first_token(
    checkpoint: Callable[[str], FsPath],
) -> None:
    """A session decodes alone (batch 1: the warm set); two more, their prompts appended before,
    join it. The graph of the three (batch 4) is captured before the step that gives the newcomers
    their first token (`DecodeGraphs.ahead`), so that every later step replays it: no step runs
    uncaptured, none waits for a capture. Greedy tokens: an engine's without graphs. A newcomer
    whose prompt that step computes has no digests yet: nothing is captured ahead for it."""
    prompts = [random_prompt(300, VOCAB_SIZE, seed=s) for s in (1, 2, 3)]
    out = []
    for graphs in (True, False):
        engine = _engine(checkpoint, graphs=graphs)
        g = engine.runner.graphs
        if graphs:
            engine.warm(kernels=False)
            while g.deferred:  # the warm set captured, as an idle daemon does after ready
                engine.upkeep(idle=True)
            engine.captured.clear()
        sids = [engine.create_session() for _ in prompts]
        for sid, ids in zip(sids, prompts, strict=True):
            engine.append(sid, token_ids=ids)
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        rids = {engine.submit(sids[0], params=engine.with_sampling(max_tokens=10, ignore_eos=True)): 0}

        def step(rids: dict[int, int] = rids, tokens: dict[int, list[int]] = tokens, engine=engine) -> None:  # type: ignore[no-untyped-def]
            for event in engine.step():
                if isinstance(event, TokenDelta) and event.request_id in rids:
                    tokens[rids[event.request_id]].append(event.token_id)

        for _ in range(3):
            step()
        replays, eager = g.replays, g.eager_steps
        for i in (1, 2):
            rids[engine.submit(sids[i], params=engine.with_sampling(max_tokens=6, ignore_eos=True))] = i
        step()  # the newcomers' first tokens, the first session's fourth
        ahead = list(engine.captured), graph_stats_pb(engine).captures_ahead, set(g.ahead_keys)
        while engine.has_work:
            step()
        out.append((tokens, ahead, g.replays - replays, g.eager_steps - eager, dict(g.deferred)))
        engine.close()
    (tokens, ahead, replays, eager, deferred), (e_tokens, *_) = out
    assert tokens == e_tokens and [len(t) for t in tokens.values()] == [10, 6, 6]
    key = GraphKey(4, width_bucket(-(-(300 + 5) // BS)), 16)  # 3 sessions; the first one's table 4 tokens on
    assert ahead == ([key], 1, {key}) and key not in deferred
    # the newcomers' first step (their prompts' last token: a decode step's shape) and five more of
    # the three, then the first session's last token alone (batch 1)
    assert eager == 0 and replays == 1 + 5 + 1

    engine = _engine(checkpoint, graphs=True)
    engine.warm(kernels=False)
    a, b = engine.create_session(), engine.create_session()
    engine.append(a, token_ids=prompts[0])
    engine.submit(a, params=engine.with_sampling(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.submit(b, token_ids=prompts[1], params=engine.with_sampling(max_tokens=4, ignore_eos=True))
    while engine.has_work:
        engine.step()
    assert engine.runner.graphs.captures_ahead == 0  # b's prompt computed with its first token: no digests before
    engine.close()


@pytest.mark.parametrize("policy", ["exact", "attention_entropy"])
def test_graphs_made_from_padding_replay_real_steps_as_the_eager_path_does(
    checkpoint: Callable[[str], FsPath], policy: str
) -> None:
    """Greedy tokens and logits of a warmed engine (every decode step through a graph of the warm
    set, made from padding inputs before any session existed) against an engine without graphs."""
    prompt = random_prompt(400, VOCAB_SIZE, seed=7)  # past the 192-token window: attention_entropy selects
    out = []
    for graphs in (True, False):
        engine = _engine(checkpoint, graphs=graphs)
        if graphs:
            engine.warm(kernels=False)
        sid = engine.create_session(policy=policy)
        logits: list[torch.Tensor] = []
        original = engine.runner.execute

        def spy(plan, all_logits=False, original=original, logits=logits):  # type: ignore[no-untyped-def]
            report = original(plan, all_logits)
            if len(report.logits):  # (a prompt's chunks before its last want none)
                logits.append(report.logits[-1].float().clone())
            return report

        engine.runner.execute = spy  # type: ignore[method-assign]
        events = engine.generate(sid, token_ids=prompt, params=engine.with_sampling(max_tokens=12, ignore_eos=True))
        tokens = [e.token_id for e in events if isinstance(e, TokenDelta)]
        out.append((tokens, logits[-12:], engine.runner.graphs.replays, engine.runner.graphs.built))
        engine.close()
    (tokens, logits, replays, built), (e_tokens, e_logits, e_replays, _) = out
    assert replays == 12 and e_replays == 0  # every token from a warm graph (the prompt's last token fed with it)
    assert built == len(_engine_keys(checkpoint))  # none made beyond the warm set
    assert tokens == e_tokens
    for x, y in zip(logits, e_logits, strict=True):
        np.testing.assert_allclose(x.cpu().numpy(), y.cpu().numpy(), rtol=2e-4, atol=2e-4)


def test_a_graph_writes_only_the_moved_blocks_locations_of_tables_that_changed(
    checkpoint: Callable[[str], FsPath],
) -> None:
    """Two sessions decode together through one graph with HBM for about half their blocks: each
    step's promotions move blocks, and a new block comes every 16 tokens. The graph writes the
    locations of those blocks alone (`BlockTable.moves_since`), and the invariant checks after
    every step compare the graph's tables with the whole tables; the greedy tokens are an
    engine's without graphs, with the same tiers."""
    prompts = [random_prompt(400, VOCAB_SIZE, seed=s) for s in (5, 6)]
    probe = _engine(checkpoint, graphs=False)
    block, layers = probe.kv.tiers.block_bytes, probe.kv.blocks.num_layers
    probe.close()
    hbm_mb = 26 * layers * block / 2**20  # half of two 400-token sessions' blocks (and their growth)
    out = []
    for graphs in (True, False):
        engine = _engine(checkpoint, graphs=graphs, hbm_mb=hbm_mb)
        g = engine.runner.graphs
        if graphs:
            engine.warm(kernels=False)
        sids = [engine.create_session() for _ in prompts]
        for sid, ids in zip(sids, prompts, strict=True):
            engine.append(sid, token_ids=ids)
        rids = {
            engine.submit(sid, params=engine.with_sampling(max_tokens=40, ignore_eos=True)): i
            for i, sid in enumerate(sids)
        }
        tokens: list[list[int]] = [[], []]
        while engine.has_work:
            for event in engine.step():
                if isinstance(event, TokenDelta):
                    tokens[rids[event.request_id]].append(event.token_id)
            engine.upkeep()
        out.append((tokens, dict(g.table_writes), g.replays + g.eager_steps, engine.kv.tiers.counters.promote_count))
        engine.close()
    (tokens, writes, graph_steps, promoted), (e_tokens, *_) = out
    assert tokens == e_tokens and all(len(t) == 40 for t in tokens)
    assert graph_steps >= 39 and promoted > 0  # the decode through the graph, blocks promoted into HBM
    assert writes["moved"] > 3 * writes["whole"]  # most slots' updates were their moved blocks alone


def _engine_keys(checkpoint: Callable[[str], FsPath]) -> list[GraphKey]:
    engine = _engine(checkpoint, graphs=True)
    keys = engine.runner.graphs.warm_set(engine.max_context)
    engine.close()
    return keys


def test_a_warm_set_left_for_after_ready_is_captured_one_graph_a_turn_wanted_ones_first(
    checkpoint: Callable[[str], FsPath], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`warm(graphs_now=False)` (the daemon's default, `graphs_before_ready` off): nothing
    captured before ready, the whole set waiting; each idle turn captures one graph, the one
    steps wanted first; while busy, a warm graph waits `DEFER_STEPS` steps as any other; a step
    before its graph is captured decodes uncaptured, its tokens an engine's without graphs."""
    engine = _engine(checkpoint, graphs=True)
    g = engine.runner.graphs
    monkeypatch.setattr(g, "_current", lambda key: key in g.capture_s)  # (a CPU "captures" in `prepare` only)
    warm = engine.warm(kernels=False, graphs_now=False)
    keys = g.warm_set(engine.max_context)
    assert warm.graphs == 0 and warm.graphs_deferred == len(keys) == g.warm_waiting
    assert list(g.deferred) == keys and g.warm_keys == frozenset(keys) and not g.capture_s
    assert warm.fields()["graphs_deferred"] == len(keys)
    engine.upkeep(idle=True)  # one a turn, the first in the set's order
    assert engine.captured == [keys[0]] and g.warm_waiting == len(keys) - 1 and list(g.capture_s) == [keys[0]]
    sid = engine.create_session(policy="exact")
    prompt = random_prompt(500, VOCAB_SIZE, seed=3)
    engine.append(sid, token_ids=prompt)
    engine.submit(sid, generate=True, params=engine.with_sampling(max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_work:  # (no upkeep between these steps)
        tokens += [e.token_id for e in engine.step() if isinstance(e, TokenDelta)]
    wanted = GraphKey(1, width_bucket(500 // BS + 1))
    assert wanted in keys[2:] and g.deferred[wanted] == 4 and g.replays == 0  # every token's step, uncaptured
    engine.upkeep(idle=False)  # busy: waited DEFER_STEPS steps: captured
    assert engine.captured[-1] == wanted and wanted not in g.deferred
    engine.upkeep(idle=True)  # then the set in its order
    assert engine.captured[-1] == keys[1] and g.warm_waiting == len(keys) - 3
    g.deferred[keys[-1]] += 1  # a step wanted it: the next idle turn takes it first
    engine.upkeep(idle=True)
    assert engine.captured[-1] == keys[-1]
    while g.deferred:
        engine.upkeep(idle=True)
    assert g.capture_s.keys() == set(keys) and g.captures_after_ready == len(keys)
    other = _engine(checkpoint, graphs=False)
    sid = other.create_session(policy="exact")
    events = other.generate(sid, token_ids=prompt, params=other.with_sampling(max_tokens=4, ignore_eos=True))
    assert tokens == [e.token_id for e in events if isinstance(e, TokenDelta)] and len(tokens) == 4
    other.close()
    engine.close()


def test_the_warm_up_keeps_segments_only_where_they_agree_with_the_copying_path(
    checkpoint: Callable[[str], FsPath], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_check_segments` (on CUDA, in `warm_up`): a chunk over cached keys is attended segment by
    segment only where the device agrees with the copying path; the `warmed` event says which."""
    from h3d.kv import attention

    engine = _engine(checkpoint, graphs=False)
    monkeypatch.setattr(attention, "chunk_segments", True)
    parts: dict[str, float] = {}
    warmup._check_segments(engine, parts)
    assert attention.chunk_segments and parts["chunk_segments"] == 1.0
    merge = attention.merge_parts
    monkeypatch.setattr(attention, "merge_parts", lambda p: merge(p[1:]))  # (a device that disagrees)
    warmup._check_segments(engine, parts)
    assert not attention.chunk_segments and parts["chunk_segments"] == 0.0
    engine.close()
