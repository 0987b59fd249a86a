"""Sequences batched together compute what each computes alone.

Runner level (teacher-forced, logits within 1e-4): four sequences of 37, 100, 213 and 301 tokens
are prefilled in one forward and then decoded in steps of four one-token chunks; and in a
staggered schedule where prefill chunks of some sequences share forwards with decode steps of
others. Each is compared with the same sequence fed alone, in the same chunks.

Engine level (greedy tokens): four requests submitted together and stepped with `Engine.step`
produce the tokens each produces alone, compared up to the first step whose top-2 margin (from
the alone run's teacher-forced logits) is under 1e-3.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_match, make_engine, random_prompt, runner_logits, teacher_margins

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import FinishReason, GenerationDone, TokenDelta
from h3d.engine.step import Chunk
from h3d.kv.blocks import SeqId

TOL = 1e-4
LENGTHS = (37, 100, 213, 301)
DECODE_STEPS = 10
CONFIGS = ("llama_gqa4_tied", "qwen2_gqa4_untied", "dynamic_rope")
OFFSETS = [0, 1, 3, 4]  # the step at which each sequence of the staggered schedule starts


def _sequences(vocab: int) -> list[list[int]]:
    """Each sequence's tokens: a prompt of LENGTHS[i] tokens then DECODE_STEPS teacher-forced ones."""
    return [random_prompt(n + DECODE_STEPS, vocab, seed=100 + i) for i, n in enumerate(LENGTHS)]


def _alone(engine: Engine, seqs: list[list[int]], plans: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence fed by itself, chunk by chunk per its plan: logits of every token."""
    return [runner_logits(engine, 1000 + i, toks, plan) for i, (toks, plan) in enumerate(zip(seqs, plans, strict=True))]


def _run_schedule(
    engine: Engine, seqs: list[list[int]], plans: list[list[int]], offsets: list[int], all_logits: bool
) -> tuple[list[list[torch.Tensor]], int]:
    """Feed every sequence's plan, sequence i starting at step offsets[i], all active ones per forward.

    Returns per sequence the logits rows it got back (every token's with all_logits; else the last
    token's of each chunk, every chunk asking for logits except the prefill chunks of even steps)
    and the number of forwards that mixed a multi-token chunk with a one-token one.
    """
    runner = engine.runner
    for i in range(len(seqs)):
        runner.kv.open(SeqId(1 + i))
    pos = [0] * len(seqs)
    nxt = [0] * len(seqs)
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    mixed = 0
    step = 0
    while any(nxt[i] < len(plans[i]) for i in range(len(seqs))):
        chunks, owners = [], []
        for i, (toks, plan) in enumerate(zip(seqs, plans, strict=True)):
            if step < offsets[i] or nxt[i] >= len(plan):
                continue
            n = plan[nxt[i]]
            want = all_logits or n == 1 or step % 2 == 1
            chunks.append(Chunk(SeqId(1 + i), tuple(toks[pos[i] : pos[i] + n]), pos[i], want))
            owners.append(i)
            pos[i] += n
            nxt[i] += 1
        sizes = [len(c.token_ids) for c in chunks]
        mixed += int(min(sizes) == 1 and max(sizes) > 1)
        out = runner.step(chunks, all_logits=all_logits)
        if all_logits:
            assert out.shape[0] == sum(sizes)
            for i, part in zip(owners, out.split(sizes), strict=True):
                got[i].append(part)
        else:
            wanted = [i for i, c in zip(owners, chunks, strict=True) if c.want_logits]
            assert out.shape[0] == len(wanted)
            for i, row in zip(wanted, out, strict=True):
                got[i].append(row[None])
        step += 1
    assert pos == [len(s) for s in seqs]
    return got, mixed


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_together_then_decode_together(name: str, block_size: int, checkpoint: Callable[[str], Path]) -> None:
    engine = make_engine(checkpoint(name), block_size=block_size, max_context_tokens=1024)
    seqs = _sequences(engine.model.config.vocab_size)
    plans = [[n] + [1] * DECODE_STEPS for n in LENGTHS]
    want = _alone(engine, seqs, plans)
    got, _ = _run_schedule(engine, seqs, plans, offsets=[0, 0, 0, 0], all_logits=True)
    for i in range(len(seqs)):
        delta = (torch.cat(got[i]) - want[i]).abs().max().item()
        assert delta <= TOL, f"sequence {i} ({LENGTHS[i]} tokens): max |Δ| {delta:.3g}"


@pytest.mark.parametrize("all_logits", [True, False])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", CONFIGS)
def test_staggered_prefill_chunks_mixed_with_decode(
    name: str, block_size: int, all_logits: bool, checkpoint: Callable[[str], Path]
) -> None:
    """Prefill chunks of some sequences ride in the same forwards as decode steps of others."""
    engine = make_engine(checkpoint(name), block_size=block_size, max_context_tokens=1024)
    seqs = _sequences(engine.model.config.vocab_size)
    chunk = [37, 29, 64, 50]
    plans = []
    for n, c in zip(LENGTHS, chunk, strict=True):
        prefill = [c] * (n // c) + ([n % c] if n % c else [])
        plans.append(prefill + [1] * DECODE_STEPS)
    want = _alone(engine, seqs, plans)
    got, mixed = _run_schedule(engine, seqs, plans, offsets=OFFSETS, all_logits=all_logits)
    assert mixed >= 3, "the schedule should mix prefill chunks with decode steps"
    for i, plan in enumerate(plans):
        if all_logits:
            ref = want[i]
        else:
            # Rows come back only for the chunks that asked; chunk j of sequence i ran at step
            # OFFSETS[i] + j and asked if it was one token or ran at an odd step.
            last = torch.tensor(plan).cumsum(0) - 1
            asked = [j for j, n in enumerate(plan) if n == 1 or (OFFSETS[i] + j) % 2 == 1]
            ref = want[i][last[asked]]
        out = torch.cat(got[i])
        assert out.shape == ref.shape
        delta = (out - ref).abs().max().item()
        assert delta <= TOL, f"sequence {i}: max |Δ| {delta:.3g}"


def _submit_all(engine: Engine, prompts: list[list[int]], n: int) -> list[GenerationDone]:
    rids = []
    for p in prompts:
        sid = engine.create_session()
        rids.append(engine.submit(sid, token_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True)))
    done: dict[int, GenerationDone] = {}
    deltas: dict[int, list[int]] = {r: [] for r in rids}
    steps = 0
    widest = 0  # the most requests that got a token in one step
    while engine.has_work:
        sampled = 0
        for event in engine.step():
            if isinstance(event, TokenDelta):
                deltas[event.request_id].append(event.token_id)
                sampled += 1
            elif isinstance(event, GenerationDone):
                done[event.request_id] = event
        widest = max(widest, sampled)
        steps += 1
        assert steps < 10_000
    assert set(done) == set(rids)
    if len(rids) > 1:
        assert widest >= min(len(rids), engine.config.max_batch_size), "the requests never decoded together"
    for r in rids:
        assert list(done[r].token_ids) == deltas[r]
        assert done[r].finish_reason is FinishReason.LENGTH
    return [done[r] for r in rids]


@pytest.mark.parametrize("max_batch_size", [64, 2])
@pytest.mark.parametrize("name", ["llama_gqa4_tied", "qwen2_mha_tied"])
def test_engine_concurrent_greedy_equals_alone(
    name: str, max_batch_size: int, checkpoint: Callable[[str], Path]
) -> None:
    new = 24
    together = make_engine(checkpoint(name), prefill_chunk_tokens=64, max_batch_size=max_batch_size)
    vocab = together.model.config.vocab_size
    prompts = [random_prompt(n, vocab, seed=300 + i) for i, n in enumerate(LENGTHS)]
    got = _submit_all(together, prompts, new)
    alone_engine = make_engine(checkpoint(name), prefill_chunk_tokens=64)
    for i, p in enumerate(prompts):
        (alone,) = _submit_all(alone_engine, [p], new)
        # Margins of the alone run's choices, from its teacher-forced logits.
        margins = teacher_margins(alone_engine, p, alone.token_ids)
        assert_greedy_match(got[i].token_ids, alone.token_ids, margins)
    # Everything was released: the pool is whole again once the sessions are closed.
    for sid in list(together.sessions):
        together.close_session(sid)
    together.runner.blocks.check_invariants()
    assert together.runner.blocks.num_free == together.runner.blocks.slots_per_layer
