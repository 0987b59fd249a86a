"""The Triton paged decode kernel (run by Triton's CPU interpreter) and its torch twin, against a
float64 oracle written here.

The oracle walks each (sequence, KV head) list entry by entry: the entry's location names a pool
(HBM slot >= 0, DDR slot -(loc + 1)), the block gives `bs` tokens (`tail` for the list's last
entry), and query head h = kh * G + g takes a float64 softmax over the gathered keys.

The inputs are made to catch wrong reads: both pools hold different random values; every byte that
must never be read is NaN: slot 0 of each pool (which every padding entry of the tables names,
alternately in HBM and DDR), and the tokens of each sequence's last block past its tail. Each KV
head of a sequence lists its own random subset of the sequence's earlier blocks, in random order,
then the last block; head 0 of sequence 0 lists the last block alone, and the heads of the last
sequence list all its `W` blocks (shuffled), so that a program walks several key tiles. Tables are
random, not contiguous, and mix the two tiers. Every buffer the wrapper allocates (the output and the split
workspace) starts as NaN, so anything the kernels fail to write, or any split the merge reads that
no program wrote, shows up.

Tolerances, relative to the largest |output|: fp32 inputs give fp32 accumulations within about
1e-7 of float64, checked at 1e-5. bf16/fp16 inputs are compared with the oracle on the same values
upcast; what separates them is the output's rounding (2^-9 relative for bf16) and the
probabilities' rounding to the input dtype before the P·V product (as flash attention does), both
well inside 1e-2.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton (it reads the variable then)

import pytest
import torch

pytest.importorskip("triton")

from h3d.hbf.policy import policy_named
from h3d.kernels import decode, loader
from h3d.kernels.copies import copy_blocks, paged_write
from h3d.kernels.fused import add_rms_norm, rotary

NUM_SLOTS = (12, 15)  # HBM, DDR (different, so that the slabs' strides differ); slot 0 is poison

Pools = tuple[torch.Tensor, torch.Tensor]
Case = tuple[torch.Tensor, Pools, Pools, torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v, tables, nblocks, tail


def make_case(b: int, hkv: int, group: int, d: int, bs: int, width: int, dtype: torch.dtype, seed: int) -> Case:
    """Random q, pools, tables [B, Hkv, W], nblocks [B, Hkv], tail [B] as the module docstring says."""
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(hkv, n, bs, d, generator=g) for n in NUM_SLOTS]  # HBM, DDR
    v = [torch.randn(hkv, n, bs, d, generator=g) for n in NUM_SLOTS]
    for pool in (*k, *v):
        pool[:, 0] = float("nan")
    free = [(tier, slot) for tier in (0, 1) for slot in range(1, NUM_SLOTS[tier])]
    order = torch.randperm(len(free), generator=g).tolist()
    tables = torch.empty(b, hkv, width, dtype=torch.int32)
    nblocks = torch.empty(b, hkv, dtype=torch.int32)
    tail = torch.randint(1, bs + 1, (b,), generator=g, dtype=torch.int32)
    for i in range(b):
        nb = width if i == b - 1 else int(torch.randint(1, width + 1, (1,), generator=g))
        blocks = [free[order.pop()] for _ in range(nb)]
        locs = [s if t == 0 else -(s + 1) for t, s in blocks]  # the sequence's blocks, its last one last
        tier, slot = blocks[-1]
        for pool in (k[tier], v[tier]):
            pool[:, slot, int(tail[i]) :] = float("nan")  # past the tail: never written
        for kh in range(hkv):
            earlier = torch.randperm(nb - 1, generator=g).tolist()
            keep = 0 if i == kh == 0 else nb - 1 if i == b - 1 else int(torch.randint(0, nb, (1,), generator=g))
            chosen = [locs[j] for j in earlier[:keep]] + [locs[-1]]
            padding = [0 if j % 2 else -1 for j in range(width - len(chosen))]  # slot 0 of HBM / DDR
            tables[i, kh] = torch.tensor(chosen + padding, dtype=torch.int32)
            nblocks[i, kh] = len(chosen)
    # q as a strided view (rows of 2 * D), as a slice of a fused projection would be.
    q = torch.randn(b, hkv * group, 2 * d, generator=g)[..., :d].to(dtype)
    kp, vp = (k[0].to(dtype), k[1].to(dtype)), (v[0].to(dtype), v[1].to(dtype))
    return q, kp, vp, tables, nblocks, tail


def oracle(case: Case, scale: float, first: torch.Tensor | None = None) -> torch.Tensor:
    """Plain loops in float64 -> [B, H, D]; `first[b]`: the first entry's tokens not read."""
    q, k_pools, v_pools, tables, nblocks, tail = case
    b, h, d = q.shape
    hkv, _, bs, _ = k_pools[0].shape
    group = h // hkv
    out = torch.zeros(b, h, d, dtype=torch.float64)
    for i in range(b):
        for kh in range(hkv):
            n = int(nblocks[i, kh])
            keys, vals = [], []
            for j in range(n):
                loc = int(tables[i, kh, j])
                tier, slot = (0, loc) if loc >= 0 else (1, -loc - 1)
                count = int(tail[i]) if j == n - 1 else bs
                skip = int(first[i]) if first is not None and j == 0 else 0
                keys.append(k_pools[tier][kh, slot, skip:count].double())
                vals.append(v_pools[tier][kh, slot, skip:count].double())
            key, val = torch.cat(keys), torch.cat(vals)  # [T, D]
            for gq in range(group):
                head = kh * group + gq
                scores = key @ q[i, head].double() * scale  # [T]
                out[i, head] = torch.softmax(scores, dim=0) @ val
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`paged_decode`'s `alloc` here: every buffer the wrapper allocates starts as NaN."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def check_kernel(case: Case, block_split: int | None) -> None:
    q = case[0]
    scale = q.shape[-1] ** -0.5
    got = decode.paged_decode(*case, scale, block_split=block_split, alloc=poisoned)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert not torch.isnan(got).any(), "the kernels left an output unwritten or read a poisoned byte"
    err = rel_err(got, oracle(case, scale))
    assert err < TOL[q.dtype], f"relative error {err:.3g} ({q.dtype}, block_split={block_split})"


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("block_split", [1, None], ids=["split1", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_masks_a_window_start_inside_the_first_block(dtype: torch.dtype, block_split: int | None) -> None:
    """A sliding-window layer's lists (one per sequence, shared by its KV heads): the first `head`
    tokens of the first entry are never read (poisoned here), in the kernel and in its twin;
    sequence 0 lists only its last, partial block, the window starting inside it."""
    q, kp, vp, tables, nblocks, tail = make_case(b=3, hkv=2, group=4, d=32, bs=16, width=6, dtype=dtype, seed=5)
    tables[:, 1], nblocks[:, 1] = tables[:, 0], nblocks[:, 0]
    g = torch.Generator().manual_seed(6)
    head = torch.empty(3, dtype=torch.int32)
    for i in range(3):
        valid = int(tail[i]) if int(nblocks[i, 0]) == 1 else 16
        head[i] = int(torch.randint(1, valid, (1,), generator=g)) if valid > 1 else 0
        loc = int(tables[i, 0, 0])
        tier, slot = (0, loc) if loc >= 0 else (1, -loc - 1)
        for pool in (kp[tier], vp[tier]):
            pool[:, slot, : int(head[i])] = float("nan")
    case = (q, kp, vp, tables, nblocks, tail)
    scale = q.shape[-1] ** -0.5
    want = oracle(case, scale, head)
    for got in (
        decode.paged_decode(*case, scale, head=head, block_split=block_split, alloc=poisoned),
        decode.torch_paged_decode(*case, scale, head),
    ):
        assert not torch.isnan(got).any(), "a token before the window was read"
        assert rel_err(got, want) < TOL[dtype]
    assert head.sum() > 0


# 1 and 2 blocks per split; auto (2 splits of 4 here); 6 = one split, two loop steps, no merge.
@pytest.mark.parametrize("block_split", [1, 2, None, 6], ids=["split1", "split2", "auto", "whole"])
@pytest.mark.parametrize("group", [1, 4, 8], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_kernel_matches_oracle(dtype: torch.dtype, group: int, block_split: int | None) -> None:
    case = make_case(b=3, hkv=2, group=group, d=32, bs=16, width=6, dtype=dtype, seed=group * 7 + (block_split or 0))
    check_kernel(case, block_split)


@pytest.mark.parametrize(("bs", "d", "group", "block_split"), [(32, 64, 3, None), (64, 32, 2, 1), (16, 128, 5, 3)])
def test_kernel_other_shapes(bs: int, d: int, group: int, block_split: int | None) -> None:
    """Other block sizes (one block per loop step at bs 64), head dims, and group sizes that are not
    powers of two (padded query rows)."""
    check_kernel(make_case(2, 2, group, d, bs, 5, torch.float32, seed=bs + d + group), block_split)


@pytest.mark.parametrize("block_split", [1, None])
def test_kernel_single_block(block_split: int | None) -> None:
    """A sequence of one (partial) block, listed in a table wider than the list (poisoned padding)."""
    q, kp, vp, tables, nblocks, tail = make_case(2, 2, 4, 32, 16, 1, torch.float32, seed=5)
    assert (nblocks == 1).all()
    tables = torch.cat([tables, torch.full((2, 2, 4), -1, dtype=torch.int32)], dim=-1)  # DDR slot 0
    check_kernel((q, kp, vp, tables, nblocks, tail), block_split)


@pytest.mark.parametrize("group", [1, 4, 8], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_torch_path_matches_oracle(dtype: torch.dtype, group: int) -> None:
    case = make_case(3, 2, group, 32, 16, 6, dtype, seed=100 + group)
    scale = case[0].shape[-1] ** -0.5
    got = decode.torch_paged_decode(*case, scale)
    assert got.dtype == dtype and not torch.isnan(got).any()
    assert rel_err(got, oracle(case, scale)) < TOL[dtype]


def test_cpu_without_interpreter_takes_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case(2, 2, 4, 32, 16, 4, torch.float32, seed=3)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert torch.equal(decode.paged_decode(*case, 0.2), decode.torch_paged_decode(*case, 0.2))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(loader, "triton_installed", lambda: False)  # as on a host without Triton
    assert not loader.triton_available()
    assert torch.equal(decode.paged_decode(*case, 0.2), decode.torch_paged_decode(*case, 0.2))


def test_split_choice() -> None:
    cpu = torch.device("cpu")
    # One "SM" off CUDA (the interpreter runs programs one by one): at most 4 programs; a multiple
    # of CHUNK = 4 blocks (bs 16), covering W.
    assert decode.choose_block_split(b=1, hkv=1, w=64, bs=16, device=cpu) == 16  # 4 splits
    assert decode.choose_block_split(b=1, hkv=2, w=64, bs=16, device=cpu) == 32  # 2 splits: the merge runs
    assert decode.choose_block_split(b=3, hkv=2, w=6, bs=16, device=cpu) == 8  # one split: the "auto" case above
    assert decode.choose_block_split(b=8, hkv=2, w=64, bs=16, device=cpu) == 64  # wide batch: one split
    assert decode.choose_block_split(b=1, hkv=1, w=3, bs=16, device=cpu) == 4  # at least one chunk
    assert decode.choose_block_split(b=1, hkv=1, w=5, bs=64, device=cpu) == 2


def test_rejects_bad_shapes() -> None:
    assert loader.triton_available()
    q, kp, vp, tables, nblocks, tail = make_case(1, 1, 1, 32, 16, 2, torch.float32, seed=0)
    odd = tuple(p[:, :, :12] for p in kp)  # block size 12
    with pytest.raises(ValueError, match="block size"):
        decode.paged_decode(q, odd, odd, tables, nblocks, tail, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        decode.paged_decode(torch.randn(1, 1, 64), kp, vp, tables, nblocks, tail, 1.0)


# ---- the engine on the kernel path (the GPU's decode, here under the interpreter) ---------------


@pytest.mark.parametrize("planned", [False, True], ids=["host-planned", "device-planned"])
@pytest.mark.parametrize("policy", ["exact", "attention_entropy", "fixed"])
def test_engine_decode_through_the_kernel_equals_the_reference(
    checkpoint: Callable[[str], Path], policy: str, planned: bool, tmp_path: Path
) -> None:
    """The engine's decode steps through `kernel_attention` (as on CUDA) and the CPU fast path give
    the reference attention's logits: with blocks in HBM and DDR (a small HBM), with per-KV-head
    selections smaller than the context (attention_entropy), and two sequences in one step. The
    GPU's decode path (`Path.DEVICE`: locations copied once per step, selections kept on the
    device) is run here too, against the host-planned reference."""
    from helpers import VOCAB_SIZE, make_engine, random_prompt, runner_logits

    from h3d.engine.step import Chunk
    from h3d.kv.attention import kernel_attention, paged_attention, reference_attention
    from h3d.kv.blocks import SeqId

    slot = 2 * 16 * 2 * 16 * 4  # llama_gqa4_tied: one layer's K+V of a 16-token block
    overrides = {
        "policy": policy,
        "block_size": 16,
        "hbm_mb": 3 * 6 * slot / 2**20,
        "window_tokens": 64,
        "window_min_tokens": 64,
        "recent_tokens": 32,
        "dense_layers": 1,
    }
    prompts = [random_prompt(150, VOCAB_SIZE, seed=1), random_prompt(97, VOCAB_SIZE, seed=2)]
    logits = []
    reads: list[tuple[int, int, int]] = []
    for n, fn in enumerate((kernel_attention, paged_attention, reference_attention)):
        # With an archive too (the daemon always has one): nothing is archive-only here, so the
        # device plan still applies.
        archive = {"ssd_path": str(tmp_path / f"archive-{n}")} if planned else {}
        engine = make_engine(checkpoint("llama_gqa4_tied"), **overrides, **archive)
        engine.model.use_attention(fn)
        engine.runner.plan_on_device = planned and fn is not reference_attention
        out = [runner_logits(engine, i, ids, [len(ids) - 6, 1, 1, 1, 1, 1, 1]) for i, ids in enumerate(prompts)]
        both = [Chunk(SeqId(i), (7,), len(ids), True) for i, ids in enumerate(prompts)]
        out.append(engine.runner.step(both))  # a batch of two decode steps
        assert engine.tier_stats().ddr_hits > 0  # the kernel read blocks in DDR
        if engine.runner.plan_on_device:
            assert engine.runner.device_planned_steps == 2 * 6 + 1  # every decode step was planned on the device
        logits.append(torch.cat(out))
        t = engine.tier_stats()
        reads.append((t.hbm_hits, t.hbm_misses, t.ddr_hits))
        engine.close()
    assert reads[0] == reads[1] == reads[2]  # the device plan counts the blocks read as the host does
    torch.testing.assert_close(logits[0], logits[2], rtol=1e-4, atol=1e-4)  # the kernel
    torch.testing.assert_close(logits[1], logits[2], rtol=1e-4, atol=1e-4)  # the CPU fast path


@pytest.mark.parametrize("path", ["host", "device", "graphs"])
@pytest.mark.parametrize("policy", ["exact", "attention_entropy"])
@pytest.mark.parametrize("name", ["qwen2_window_layers", "gemma3_window"])
def test_sliding_window_decode_through_the_kernel_equals_the_reference(
    checkpoint: Callable[[str], Path], name: str, policy: str, path: str
) -> None:
    """A model with 24-token windows decoding through `kernel_attention` (the Triton kernel, as on
    CUDA: its window layers list the window's blocks, the start inside the first one masked) on
    each of the GPU's decode paths (planned on the host, planned on the device, and the graphs'
    static buffers, run eagerly here) gives the reference attention's logits: blocks in HBM and
    DDR, window starts at every position of a block (the decode runs 20 tokens), two sequences in
    one step, and under `attention_entropy` a full layer selecting beside the window layers (an HBF
    window of 48 tokens: the 90-token prompt is past it). The window layers' old blocks are freed."""
    from helpers import VOCAB_SIZE, make_engine, random_prompt, runner_logits

    from h3d.engine.step import Chunk
    from h3d.kv.attention import kernel_attention, reference_attention
    from h3d.kv.blocks import SeqId

    hbf = {"policy": policy, "window_tokens": 48, "window_min_tokens": 48, "recent_tokens": 16, "dense_layers": 0}
    prompts = [random_prompt(90, VOCAB_SIZE, seed=3), random_prompt(61, VOCAB_SIZE, seed=4)]
    logits = []
    for fn in (kernel_attention, reference_attention):
        engine = make_engine(checkpoint(name), hbm_mb=0.05, window_keep_tokens=0, **hbf)
        engine.model.use_attention(fn)
        fast = fn is kernel_attention
        engine.runner.plan_on_device = fast and path == "device"
        engine.runner.graphs.enabled = fast and path == "graphs"
        engine.runner.graphs.lag = False
        out = [runner_logits(engine, i, ids, [len(ids) - 20] + [1] * 20) for i, ids in enumerate(prompts)]
        out.append(engine.runner.step([Chunk(SeqId(i), (7,), len(ids), True) for i, ids in enumerate(prompts)]))
        assert engine.tier_stats().ddr_hits > 0 and engine.tier_stats().window_freed_blocks > 0
        if fast and path == "device":
            assert engine.runner.device_planned_steps == 2 * 20 + 1
        if fast and path == "graphs":  # (under HBF the shorter prompt's first steps are within its window: eager)
            assert (
                engine.runner.graphs.replays == 2 * 20 + 1 if policy == "exact" else engine.runner.graphs.replays > 20
            )
        logits.append(torch.cat(out))
        engine.close()
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["host", "device", "graphs", "graphs, the torch twin"])
def test_a_fork_selects_through_its_parents_digests_on_every_decode_path(
    checkpoint: Callable[[str], Path], path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole fork reads its shared blocks' digests where its parent's lie (`DigestStore.share`)
    on each of the GPU's decode paths (planned on the host, on the device, and the graphs' static
    buffers and selection kernels, run eagerly here), selecting every step: it decodes what its
    parent decoded, token for token, and so do two forks batched together."""
    from helpers import VOCAB_SIZE, make_engine, random_prompt

    from h3d.engine.sampling import SamplingParams
    from h3d.engine.session import TokenDelta
    from h3d.kernels import select
    from h3d.kv.attention import kernel_attention

    if path == "graphs, the torch twin":
        monkeypatch.setattr(select, "available", lambda device: False)
    hbf = {"policy": "attention_entropy", "window_tokens": 48, "window_min_tokens": 48, "recent_tokens": 16}
    engine = make_engine(checkpoint("llama_gqa4_tied"), dense_layers=0, **hbf)
    engine.model.use_attention(kernel_attention)
    engine.runner.plan_on_device = path == "device"
    engine.runner.graphs.enabled = path.startswith("graphs")
    engine.runner.graphs.lag = False
    parent = engine.create_session()
    engine.append(parent, token_ids=random_prompt(200, VOCAB_SIZE, seed=8))
    forks = [engine.fork(parent) for _ in range(3)]
    d = engine.kv.digests
    assert all(d.source(engine.session(f).seq)[1] == 199 // 16 * d.parts for f in forks)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    want = engine.complete(parent, "", greedy).token_ids
    assert engine.complete(forks[0], "", greedy).token_ids == want
    rids = {engine.submit(f, generate=True, params=greedy): i for i, f in enumerate(forks[1:])}
    outs: list[list[int]] = [[], []]
    while engine.has_work:  # (batched: both in each step)
        engine.upkeep()
        for event in engine.step():
            if isinstance(event, TokenDelta) and event.request_id in rids:
                outs[rids[event.request_id]].append(event.token_id)
    assert outs == [list(want)] * 2, outs
    if path.startswith("graphs"):
        assert engine.runner.graphs.replays > 8
    engine.close()


def test_decode_graph_buckets_equal_the_eager_path(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """`exact` decode steps through `DecodeGraphs` (the CUDA graph path's static buffers, padding
    and table caching, run eagerly on the CPU) give the reference's logits and counters: three
    sessions batched (padded to 4), one alone, blocks in HBM and DDR, tables crossing a width
    bucket (16 -> 20 blocks) while decoding."""
    from helpers import VOCAB_SIZE, make_engine, random_prompt

    from h3d.engine.graphs import batch_bucket, width_bucket
    from h3d.engine.step import Chunk
    from h3d.kv.attention import kernel_attention, reference_attention
    from h3d.kv.blocks import SeqId

    assert [batch_bucket(b) for b in (1, 2, 3, 5, 33)] == [1, 2, 4, 8, 64]
    assert [width_bucket(n) for n in (1, 16, 17, 33, 1000, 1024, 1025)] == [16, 16, 20, 40, 1024, 1024, 1280]
    slot = 2 * 16 * 2 * 16 * 4  # llama_gqa4_tied: one layer's K+V of a 16-token block
    prompts = [random_prompt(n, VOCAB_SIZE, seed=n) for n in (250, 97, 180)]
    results = []
    for graphs in (True, False):
        engine = make_engine(
            checkpoint("llama_gqa4_tied"), policy="exact", block_size=16, hbm_mb=40 * slot / 2**20,
            ssd_path=str(tmp_path / f"archive-{graphs}"),
        )  # fmt: skip
        engine.model.use_attention(kernel_attention if graphs else reference_attention)
        runner = engine.runner
        runner.graphs.enabled = graphs
        out = []
        for i, ids in enumerate(prompts):
            runner.kv.open(SeqId(i))
            runner.step([Chunk(SeqId(i), tuple(ids), 0, False)])
        pos = [len(ids) for ids in prompts]
        for step in range(12):
            batch = [0, 1, 2] if step % 3 else [0]  # 3 sessions (a padded bucket), or one
            chunks = [Chunk(SeqId(i), ((step * 7 + i) % VOCAB_SIZE,), pos[i], True) for i in batch]
            out.append(runner.step(chunks))
            for i in batch:
                pos[i] += 1
        t = engine.tier_stats()
        assert t.ddr_hits > 0  # some blocks were read from DDR
        results.append((torch.cat(out), (t.hbm_hits, t.hbm_misses, t.ddr_hits), runner.graphs.replays))
        engine.close()
    (graphed, reads, replays), (eager, eager_reads, _) = results
    assert replays == 12  # every decode step went through a bucket
    assert reads == eager_reads
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)


_EAGER_HBF_STEPS: list[tuple] = []  # the eager run of the test below (one per module: it never changes)


@pytest.mark.parametrize(
    ("lag", "fused"), [(False, True), (True, True), (False, False)], ids=["now", "lagged", "now-torch-twin"]
)
def test_hbf_decode_graph_equals_the_eager_path(
    checkpoint: Callable[[str], Path], lag: bool, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`attention_entropy` decode steps through `DecodeGraphs` (selection inside the step with fixed
    shapes, `select_static`; run eagerly on the CPU) give the eager path's logits, selections,
    promotions and counters: prompt anchors, HBM too small for the selections (promotions evict,
    reads from DDR), a session under exact batched with three under HBF, batches that change
    (other sessions in the same slots, the same sessions in other slots: the graph of their shape
    is replayed, none is made for them), windows that shrink every 16 steps (the same graphs: one
    top-k capacity, each slot its own room).
    With the picks promoted during the next step (`lag`, the GPU default) the blocks sit elsewhere
    for a step: the same logits, the same picks promoted one step later, as many blocks read.
    Selection through the kernels (`h3d.kernels.select`, `fused`) or their torch twin."""
    import numpy as np
    from helpers import VOCAB_SIZE, make_engine, random_prompt

    from h3d.engine.graphs import batch_bucket, room_bucket, width_bucket
    from h3d.engine.step import Chunk
    from h3d.hbf.policy import base_sizes
    from h3d.kernels import select

    if not fused:
        monkeypatch.setattr(select, "available", lambda device: False)
    from h3d.kv.attention import kernel_attention, reference_attention
    from h3d.kv.blocks import SeqId

    assert [room_bucket(n) for n in (1, 8, 9, 55, 64, 65)] == [8, 8, 16, 64, 64, 128]
    slot = 2 * 16 * 2 * 16 * 4  # llama_gqa4_tied: one layer's K+V of a 16-token block
    prompts = [random_prompt(n, VOCAB_SIZE, seed=n) for n in (300, 250, 400, 180)]
    steps = 30  # session 0 decodes 20 of them: its window resizes once
    results = []
    for graphs in (True, False):
        if not graphs and _EAGER_HBF_STEPS:  # the eager path's run is the same for every variant
            results.append(_EAGER_HBF_STEPS[0])
            continue
        engine = make_engine(
            checkpoint("llama_gqa4_tied"), policy="attention_entropy", block_size=16, hbm_mb=60 * slot / 2**20,
            window_tokens=192, window_min_tokens=64, window_max_tokens=256, recent_tokens=32, dense_layers=1,
            entropy_shrink_below=100.0, entropy_grow_above=200.0,  # every resize shrinks
        )  # fmt: skip
        engine.model.use_attention(kernel_attention if graphs else reference_attention)
        runner = engine.runner
        runner.graphs.enabled = graphs
        runner.graphs.lag = lag
        for i, ids in enumerate(prompts):
            runner.kv.open(SeqId(i), policy=policy_named("exact") if i == 3 else None)
            runner.step([Chunk(SeqId(i), tuple(ids), 0, False)])  # final: HBF's anchors are probed
        assert runner.kv.selection(SeqId(0)).head_anchors
        pos = [len(ids) for ids in prompts]
        out, picks = [], []
        calls: list[dict] = []  # every promotion's picks, in order
        original = runner.kv.promoter.promote

        def spy(selected, protect, keep, counted=False, calls=calls, original=original, kv=runner.kv):  # type: ignore[no-untyped-def]
            # (layer, block) as layer * 2**20 + block: a key's stride is the table's capacity at
            # the promotion, which may have grown by the next step (lagged picks); heads may repeat a key.
            cap = {s: kv.blocks.table(s).capacity for s in selected}
            calls.append({s: np.unique(k // cap[s] * 2**20 + k % cap[s]) for s, k in selected.items()})
            original(selected, protect, keep, counted)

        runner.kv.promoter.promote = spy  # type: ignore[method-assign]
        sinks, recent = base_sizes(runner.hbf, 16)
        shapes: dict[tuple, set[tuple[int, ...]]] = {}  # each step's graph shape -> the batches it served
        for step in range(steps):
            batch = [[0, 1, 2], [0, 1, 2, 3], [2, 0, 1], [0], [1, 2], [2]][step % 6]
            nbs = {i: pos[i] // 16 + 1 for i in batch}  # with the new token
            rooms = [
                min(runner.kv.window_tokens(SeqId(i)) // 16 - sinks - recent, nbs[i] - sinks - recent)
                for i in batch if i != 3
            ]  # fmt: skip
            k = max(runner.graphs.capacity, room_bucket(max(rooms)))
            shape = (batch_bucket(len(batch)), width_bucket(max(nbs.values())), k, 3 in batch)
            shapes.setdefault(shape, set()).add(tuple(batch))
            chunks = [Chunk(SeqId(i), ((step * 7 + i) % VOCAB_SIZE,), pos[i], True) for i in batch]
            first = len(calls)
            out.append(runner.step(chunks))
            picks.append(calls[first:])
            for i in batch:
                pos[i] += 1
        runner.kv.flush_lagged()  # the last step's picks, when lagged
        picks.append(calls[sum(len(p) for p in picks) :])
        runner.kv.promoter.promote = original  # type: ignore[method-assign]
        t = engine.tier_stats()
        assert t.ddr_hits > 0 and t.hbm_evict_count > 0  # reads from DDR, promotions that evicted
        windows = [runner.kv.window_tokens(SeqId(i)) for i in range(3)]
        results.append((out, picks, (t.hbm_hits, t.hbm_misses, t.ddr_hits), windows, runner.graphs, shapes))
        if not graphs:
            _EAGER_HBF_STEPS.append((*results[-1][:4], None, shapes))
        engine.close()
    (graphed, g_picks, reads, windows, g, shapes), (eager, e_picks, eager_reads, e_windows, _, _) = results
    assert windows == e_windows and windows[0] < 192  # the windows shrank alike
    assert g.captures == 0 and g.replays == steps  # every step replayed a graph's buffers
    assert g.built == len(shapes)  # one graph per shape, whoever is in its slots
    assert any(len(batches) > 1 for batches in shapes.values())  # some graph served several batches
    if lag:  # the same picks, each promoted at the next step (the last at the final flush)

        def every(steps: list) -> dict:
            return {q: sorted(c[q].tobytes() for step in steps for c in step if q in c) for q in map(SeqId, range(3))}

        assert every(g_picks) == every(e_picks)
        assert sum(reads[:2]) == sum(eager_reads[:2])  # as many blocks read, some elsewhere
    else:
        for step, (a, b) in enumerate(zip(g_picks, e_picks, strict=True)):
            assert [c.keys() for c in a] == [c.keys() for c in b], step
            for ca, cb in zip(a, b, strict=True):
                for seq in ca:
                    np.testing.assert_array_equal(ca[seq], cb[seq], err_msg=f"step {step} seq {seq}")
        assert reads == eager_reads
    for a, b in zip(graphed, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("hkv", "group", "parts"), [(2, 4, 2), (1, 1, 1), (4, 8, 4)])
@pytest.mark.parametrize("way", [{}, {"flat": False, "tile": 64}, {"flat": False, "tile": 32, "num_warps": 2}])
def test_hbf_selection_kernels_pick_what_the_twin_picks(
    seed: int, hkv: int, group: int, parts: int, way: dict[str, Any]
) -> None:
    """`h3d.kernels.select` (scores -> top_room -> lists) against `select_static`: the same lists per
    head (sinks first, the recent blocks last, the partial one at the end), their locations from
    the table, 0 past each list, the lengths; the raw
    bounds equal `block_scores` (past the context: -inf). Anchors past the context are clamped, a
    room below the capacity leaves the top-k's tail unused, a 70-block table spans five programs
    (two with 64 blocks a program). `way`: how `scores` reads the digests (every way the same)."""
    from h3d.hbf.digests import block_scores
    from h3d.hbf.policy import HbfConfig, base_sizes, select_static
    from h3d.kernels import select

    g = torch.Generator().manual_seed(seed)
    d, w, k = 16, 70, 16
    cfg = HbfConfig(
        policy="attention_entropy", window_tokens=512, window_min_tokens=64, window_max_tokens=1024,
        sink_blocks=1, recent_tokens=64, dense_layers=1, entropy_shrink_below=3.0, entropy_grow_above=3.3,
    )  # fmt: skip
    bs = 32
    sinks, recent = base_sizes(cfg, bs)
    nb = torch.tensor(int(torch.randint(30, w + 1, (1,), generator=g)))
    room = torch.tensor(int(torch.randint(1, k + 1, (1,), generator=g)))
    take = torch.tensor(int(torch.randint(0, 5, (1,), generator=g)))
    digests = torch.randn(hkv, w, parts, 2, d, generator=g).sort(dim=3).values  # (min, max) per part
    q = torch.randn(hkv * group, d, generator=g)
    anchors = torch.randint(0, w + 10, (hkv, 6), generator=g)  # some past the context
    table = torch.randint(-50, 50, (w,), generator=g, dtype=torch.int32)
    live = nb * parts - int(torch.randint(0, parts, (1,), generator=g))  # the last block partly written
    digests.view(hkv, -1, 2, d)[:, live:, 0] = torch.finfo(torch.float32).max  # empty parts, as the store keeps them
    digests.view(hkv, -1, 2, d)[:, live:, 1] = torch.finfo(torch.float32).min
    want = select_static(cfg, q, digests, nb, room, take, anchors, k, 1.0, bs)  # [Hkv, n_pick]
    # A batch of 3 slots: slot 2 is the session, its digests at row `base` of an arena of other
    # rows; slot 1 a session that does not select (room 0: its whole table); slot 0 padding.
    base = 5 * parts
    arena = torch.randn(hkv, base + (w + 3) * parts, 2, d, generator=g).sort(dim=2).values
    arena[:, base : base + w * parts] = digests.view(hkv, w * parts, 2, d)
    qs = torch.randn(3, hkv * group, d, generator=g)
    qs[2] = q
    bases, nbs = torch.tensor([0, 0, base]), torch.stack([torch.tensor(1), nb, nb])
    lives, takes, rooms = (torch.tensor([0, 0, int(x)]) for x in (live, take, room))
    slot_anchors = torch.zeros(3, hkv, 6, dtype=torch.int64)
    slot_anchors[2] = anchors
    masked, raw = torch.empty(3, hkv, w), torch.empty(3, hkv, w)
    select.scores(masked, qs, arena, parts, bases, nbs, lives, takes, slot_anchors, sinks, recent, raw, **way)
    assert torch.isneginf(masked[:2]).all() and torch.isneginf(raw[:2]).all()  # no live part: nothing read
    top = select.top_room(masked, rooms, k)  # [3, Hkv, k]: each row's room best, ascending
    assert not top[:2].any()
    width = w + 3  # wider than a table (a mixed batch's lists): the tails are zeroed
    heads = torch.full((3, hkv, width), 99, dtype=torch.int32)
    nblocks = torch.zeros(3, hkv, dtype=torch.int32)
    picked = torch.full((3, hkv, sinks + k + recent), -7, dtype=torch.int64)
    tables = torch.stack([table, table, table]) * torch.tensor([0, 1, 1], dtype=torch.int32)[:, None]
    select.lists(top, tables, nbs, rooms, heads, nblocks, picked, sinks, recent)
    n = sinks + int(room) + recent
    assert nblocks.tolist() == [[1] * hkv, [int(nb)] * hkv, [n] * hkv]  # padding, a whole table, the selection
    got = picked[2, :, :n]  # the twin lists its top blocks best first, the kernels ascending: same sets
    assert torch.equal(got.sort(dim=1).values, want[:, :n].sort(dim=1).values)
    assert torch.equal(got[:, :sinks], want[:, :sinks]) and torch.equal(got[:, n - recent :], want[:, n - recent : n])
    assert torch.equal(heads[2, :, :n], table[got]) and not heads[2, :, n:].any()
    assert torch.equal(heads[1, :, : int(nb)], table[: int(nb)].expand(hkv, -1)) and not heads[1, :, int(nb) :].any()
    assert not heads[0].any()  # padding: the null slot, 0 past it
    bound = block_scores(q, digests[:, : int(nb)], per_head=True)
    torch.testing.assert_close(raw[2, :, : int(nb)], bound, rtol=1e-5, atol=1e-5)
    assert torch.isinf(raw[2, :, int(nb) :]).all()


@pytest.mark.parametrize("shared_blocks", [0, 3, 40])
@pytest.mark.parametrize("flat", [False, True])
def test_selection_scores_read_a_forks_first_parts_from_its_source(shared_blocks: int, flat: bool) -> None:
    """A slot whose first parts are another session's rows (`DigestStore.share`: `src` below
    `shared`, its own rows from base + shared on) scores what the same digests in one run score,
    in the kernel and in the graphs' torch twin's row rule."""
    from h3d.hbf.digests import block_scores
    from h3d.kernels import select

    g = torch.Generator().manual_seed(shared_blocks)
    hkv, group, parts, d, w = 2, 4, 2, 16, 44
    digests = torch.randn(hkv, w * parts, 2, d, generator=g).sort(dim=2).values
    shared = shared_blocks * parts
    src, own = 3 * parts, 60 * parts  # the source's rows, then unrelated ones, then the slot's own
    arena = torch.randn(hkv, own + w * parts, 2, d, generator=g).sort(dim=2).values
    arena[:, src : src + shared] = digests[:, :shared]
    arena[:, own : own + w * parts - shared] = digests[:, shared:]
    base = own - shared  # (virtual: part p >= shared lies at base + p)
    q = torch.randn(1, hkv * group, d, generator=g)
    masked, raw = torch.empty(1, hkv, w), torch.empty(1, hkv, w)
    one = torch.ones(1, dtype=torch.int64)
    select.scores(
        masked, q, arena, parts, one * base, one * w, one * w * parts, one * 0,
        torch.zeros(1, hkv, 0, dtype=torch.int64), 1, 1, raw, (one * src, one * shared), flat=flat, tile=16,
    )  # fmt: skip
    want = block_scores(q[0], digests.view(hkv, w, parts, 2, d), per_head=True)
    torch.testing.assert_close(raw[0], want, rtol=1e-5, atol=1e-5)
    span = torch.arange(w * parts)
    rows = torch.where(span < shared, src + span, base + span)  # the twin's rule (`_select_torch`)
    assert torch.equal(arena[:, rows], digests)


@pytest.mark.parametrize("seed", range(6))
def test_top_room_kernel_takes_each_rows_best(seed: int) -> None:
    """`h3d.kernels.select.top_room` writes each row's `room` highest scores' blocks (ties: the lowest
    blocks), ascending, then zeros: rows with +inf (anchors), -inf (the base, past the end),
    repeated and negative values, rooms from 1 to the capacity, each entry its own batch row."""
    from h3d.kernels import select

    g = torch.Generator().manual_seed(seed)
    e, hkv, w, k = 2, 3, 70, 16
    masked = torch.randn(e, hkv, w, generator=g).round(decimals=1)  # ties
    masked[..., :2] = float("-inf")
    masked[..., 60:] = float("-inf")
    masked[:, :, 5] = float("inf")
    room = torch.randint(0 if seed % 2 else 1, k + 1, (e,), generator=g)
    out = select.top_room(masked, room, k)
    for s in range(e):
        r = int(room[s])
        for h in range(hkv):
            row = masked[s, h].tolist()
            want = sorted(sorted(range(w), key=lambda j, row=row: (-row[j], j))[:r])
            assert out[s, h, :r].tolist() == want, (s, h)
            assert not out[s, h, r:].any()


@pytest.mark.parametrize("pos", [0, 7, 8, 45, 63])
def test_digest_fold_kernel_equals_the_store_update(pos: int) -> None:
    """`h3d.kernels.select.fold` folds each slot's key into the arena row it is given (a session's
    part, or the null extent for a slot that keeps no digests) exactly as `DigestStore.update`
    does (min and max per dimension), and as the store's own `fold` (its twin); nothing else of
    any session changes."""
    from h3d.hbf.digests import DigestStore
    from h3d.kernels import select
    from h3d.kv.blocks import SeqId

    g = torch.Generator().manual_seed(pos)
    stores = [DigestStore(2, 3, 16, 32, torch.float32, torch.device("cpu"), part_tokens=8) for _ in range(2)]
    seq, other = SeqId(1), SeqId(2)
    first, second = torch.randn(40, 3, 16, generator=g), torch.randn(64, 3, 16, generator=g)
    for store in stores:
        store.update(other, 1, 0, first)
        store.update(seq, 1, 0, second)
    store, twin = stores
    ref, ref_other = store.layer(seq, 1).clone(), store.layer(other, 1).clone()
    keys = torch.randn(2, 3, 16, generator=g) * 3
    rows = torch.tensor([store.base(seq) + pos // 8, 0])  # slot 1: no session, the null extent
    select.fold(store.arena(1), rows, keys)
    twin.fold(1, rows, keys)
    part = pos // 8
    want = ref.clone()
    want[:, part, 0] = torch.minimum(ref[:, part, 0], keys[0])
    want[:, part, 1] = torch.maximum(ref[:, part, 1], keys[0])
    assert torch.equal(store.layer(seq, 1), want) and torch.equal(twin.layer(seq, 1), want)
    assert torch.equal(store.layer(other, 1), ref_other) and torch.equal(twin.layer(other, 1), ref_other)


@pytest.mark.parametrize(
    ("dtype", "group", "d", "keys", "cuts"),
    [
        (torch.float32, 4, 16, 13 * 16 + 5, ()),  # rows past one tile, keys past a tile's end
        (torch.float32, 1, 24, 200, (70, 199)),  # a head size that is no power of two; three segments
        (torch.bfloat16, 4, 16, 300, (250,)),  # the prefix's view and the chunk's own keys
        (torch.bfloat16, 2, 32, 40, ()),  # fewer keys than queries' rows
    ],
)
def test_probe_key_mass_kernel_equals_the_oracle(
    dtype: torch.dtype, group: int, d: int, keys: int, cuts: tuple[int, ...]
) -> None:
    """`h3d.kernels.probe.key_mass`: the softmax mass each key draws from the last m queries' rows
    of its KV head (a key after a row's query draws none), summed over the rows, against a float64
    softmax over the same values (the queries rounded to the keys' dtype, as the kernel rounds
    them); the keys in segments (strided views) give the same as whole. Each row's mass sums to
    1, so a head's keys sum to its rows."""
    from h3d.kernels import probe

    g = torch.Generator().manual_seed(keys + d)
    hkv, m = 2, min(64, keys)
    q = torch.randn(hkv, m * group, d, generator=g) * 0.3
    pool = torch.randn(keys, hkv, d, generator=g).to(dtype)  # [T, Hkv, D]: as the chunk's K is laid out
    k = pool.transpose(0, 1)  # [Hkv, T, D], a strided view
    bounds = (0, *cuts, keys)
    segments = [k[:, a:b] for a, b in itertools.pairwise(bounds)]
    got = probe.key_mass(q, segments, m, group)
    s = torch.einsum("hrd,htd->hrt", q.to(dtype).double(), k.double())
    qpos = keys - m + torch.arange(m * group) // group
    s = s.masked_fill(torch.arange(keys)[None, None, :] > qpos[None, :, None], float("-inf"))
    want = torch.softmax(s, dim=-1).sum(dim=1)
    assert got.shape == (hkv, keys) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.sum(dim=1).double(), torch.full((hkv,), float(m * group), dtype=torch.float64))
    whole = probe.key_mass(q, [k], m, group)
    torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-6)
    wide = torch.full((hkv, keys + 7), -1.0)  # written in place: the first columns of a wider buffer
    assert probe.key_mass(q, segments, m, group, out=wide[:, :keys]).data_ptr() == wide.data_ptr()
    assert torch.equal(wide[:, :keys], got) and bool((wide[:, keys:] == -1.0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("triton", [True, False], ids=["kernel", "torch"])
def test_paged_write_stores_each_row_in_its_tier(
    dtype: torch.dtype, triton: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`paged_write` puts token n's K/V of every KV head at its row: HBM rows >= 0, DDR rows
    -(row + 1); nothing else changes. K and V with different strides (slices of one projection)."""
    g = torch.Generator().manual_seed(3)
    hkv, bs, d = 2, 16, 64
    pools = [torch.zeros(hkv, slots, bs, d, dtype=dtype) for slots in (5, 5, 7, 7)]  # HBM K, V, DDR K, V
    hk, hv, dk, dv = pools
    before = [p.clone() for p in pools]
    qkv = torch.randn(4, 3 * hkv, d, generator=g).to(dtype).float()  # exact in `dtype`: the cast cannot round
    k, v = qkv[:, hkv : 2 * hkv], qkv[:, 2 * hkv :]  # non-contiguous views, as in the model
    rows = torch.tensor([3, -1, 5 * bs - 1, -(7 * bs)], dtype=torch.int64)  # HBM, DDR row 0, last HBM, last DDR
    if not triton:
        monkeypatch.setattr(loader, "triton_installed", lambda: False)
    paged_write(k, v, (hk, dk), (hv, dv), rows)
    want = [p.clone() for p in before]
    for n, r in enumerate(rows.tolist()):
        pk, pv, row = (want[0], want[1], r) if r >= 0 else (want[2], want[3], -r - 1)
        pk.view(hkv, -1, d)[:, row] = k[n].to(dtype)
        pv.view(hkv, -1, d)[:, row] = v[n].to(dtype)
    for got, exp in zip(pools, want, strict=True):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("triton", [True, False], ids=["kernel", "torch"])
def test_copy_blocks_moves_whole_blocks_between_pools(
    dtype: torch.dtype, triton: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`copy_blocks` copies each listed slot's block, every KV head, K and V, from one pool to the
    other (DDR -> HBM: promotion; HBM -> DDR: eviction's copies), in any slot order; nothing
    else changes. Block tiles of 3 x 20 elements: a padded, masked program."""
    g = torch.Generator().manual_seed(4)
    hkv, bs, d = 3, 3, 20
    hbm = [torch.randn(hkv, 6, bs, d, generator=g).to(dtype) for _ in range(2)]  # K, V
    ddr = [torch.randn(hkv, 9, bs, d, generator=g).to(dtype) for _ in range(2)]
    if not triton:
        monkeypatch.setattr(loader, "triton_installed", lambda: False)
    for src, dst, a, b in ((ddr, hbm, [7, 1, 4], [2, 5, 1]), (hbm, ddr, [3, 2], [8, 0])):
        want = [x.clone() for x in dst]
        for w, x in zip(want, src, strict=True):
            for i, j in zip(a, b, strict=True):
                w[:, j] = x[:, i]
        copy_blocks((src[0], src[1]), torch.tensor(a), (dst[0], dst[1]), torch.tensor(b))
        for got, exp in zip(dst, want, strict=True):
            torch.testing.assert_close(got, exp, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_kernel_equals_the_torch_ops(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused residual add + RMSNorm kernel gives the plain ops' sum exactly and their norm
    within a rounding of the dtype (hidden 200: a padded, masked row)."""
    g = torch.Generator().manual_seed(5)
    x, res = (torch.randn(3, 200, generator=g).to(dtype) for _ in range(2))
    w = (torch.rand(200, generator=g) + 0.5).to(dtype)
    got_sum, got_norm = add_rms_norm(x, res, w, 1e-5)
    monkeypatch.setattr(loader, "triton_installed", lambda: False)
    want_sum, want_norm = add_rms_norm(x, res, w, 1e-5)
    tol = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(got_sum, want_sum, rtol=tol, atol=0.0)
    torch.testing.assert_close(got_norm.float(), want_norm.float(), rtol=2 * tol + 1e-6, atol=1e-6)
    assert want_norm.abs().max() > 0.5


def test_model_with_fused_norms_equals_the_plain_model(checkpoint: Callable[[str], Path]) -> None:
    """The decoder with its fused kernels (residual add + RMSNorm, RoPE: the GPU's default, here
    under the interpreter) gives the plain decoder's logits, prefill and decode."""
    from helpers import VOCAB_SIZE, make_engine, random_prompt, runner_logits

    ids = random_prompt(40, VOCAB_SIZE, seed=4)
    out = []
    for fused in (True, False):
        engine = make_engine(checkpoint("llama_gqa4_tied"), policy="exact", block_size=16)
        engine.model.use_fused(fused)
        out.append(runner_logits(engine, 0, ids, [30, 1, 1, 1, 1, 1, 1, 1, 1, 1]))
        engine.close()
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_equals_the_torch_ops(dtype: torch.dtype) -> None:
    """RoPE in one launch equals `apply_rotary` (q and k heads side by side, a strided view)."""
    from h3d.model.rope import apply_rotary

    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, 12, 64, generator=g).to(dtype)
    x = qkv[:, :10]  # rows of 10 heads out of 12: strided like the model's q/k slice
    angle = torch.rand(5, 32, generator=g) * 6
    cos, sin = (torch.cat((f(angle), f(angle)), dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    # fp32: equal; bf16: within one rounding (Triton 3.6's interpreter rounds its bf16 casts
    # differently from torch; the GPU rounds to nearest even, as torch does).
    tol = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    got, want = rotary(x, cos, sin), apply_rotary(x, cos, sin)
    torch.testing.assert_close(got, want, rtol=tol, atol=4 * tol)
    assert want.abs().max() > 1.0


class _Launches:
    """A kernel stand-in that records its launches (positional arguments by parameter name, and
    the `constexpr` keywords) instead of running them."""

    def __init__(self, fn: Callable[..., object]) -> None:
        import inspect

        self.params = list(inspect.signature(fn).parameters)
        self.ints: dict[str, set[int]] = {}
        self.constants: set[tuple[tuple[str, object], ...]] = set()

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: object, **kw: object) -> None:
            for name, arg in zip(self.params, args, strict=False):
                if isinstance(arg, int) and not isinstance(arg, bool):
                    self.ints.setdefault(name, set()).add(arg)
            self.constants.add(tuple(sorted((k, str(v)) for k, v in kw.items())))

        return launch


def _record(
    monkeypatch: pytest.MonkeyPatch, module: object, kernels: dict[str, Callable[..., object]]
) -> dict[str, _Launches]:
    from types import SimpleNamespace

    launches = {name: _Launches(fn) for name, fn in kernels.items()}
    monkeypatch.setattr(module, "_kernels", lambda: SimpleNamespace(**launches))
    monkeypatch.setattr(module, "triton", loader.load().triton)
    monkeypatch.setattr(module, "tl", loader.load().tl)
    return launches


def _check_variants(launches: dict[str, _Launches], loose: dict[str, tuple[str, ...]], most: dict[str, int]) -> None:
    """Every integer argument that took more than one value is one the kernel does not specialize
    on (Triton would compile again where it turns 1, a multiple of 16, or neither), and the
    `constexpr` keywords took at most `most[kernel]` combinations (each one a compile)."""
    for name, rec in launches.items():
        varying = sorted(p for p, seen in rec.ints.items() if len(seen) > 1)
        assert set(varying) <= set(loose.get(name, ())), (name, set(varying) - set(loose.get(name, ())))
        assert 0 < len(rec.constants) <= most[name], (name, len(rec.constants))


def test_decode_kernels_compile_a_handful_of_variants_whatever_the_widths(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host-planned step lists each layer's selection at its own width: over every width up to
    4,096 blocks and batches of 1 to 16 on a 132-SM card, the split and merge kernels' launches
    vary only in what they do not specialize on, and in a power-of-two padding of the splits:
    at most 2 variants of the split kernel (one split or several) and 8 of the merge (`SPLITS_PAD`),
    all of which `warm_decode` launches. With the count of splits a `constexpr` (as before), the
    merge took a variant per count (66 at batch 1)."""
    launches = _record(monkeypatch, decode, {"split": decode._split_kernel, "merge": decode._merge_kernel})
    monkeypatch.setattr(decode, "_sm_count", lambda device: 132)
    hkv, group, d, bs = 8, 4, 128, 32
    pools = (torch.zeros(hkv, 2, bs, d), torch.zeros(hkv, 3, bs, d))
    for b in (1, 2, 3, 16):
        for w in [*range(1, 300), *range(300, 4097, 37)]:
            q = torch.zeros(b, hkv * group, d)
            tables = torch.zeros(b, hkv, w, dtype=torch.int32)
            nblocks = torch.full((b, hkv), w, dtype=torch.int32)
            tail = torch.full((b,), bs, dtype=torch.int32)
            decode._triton_paged_decode(q, pools, pools, tables, nblocks, tail, 1.0, None, decode._empty)
            shared = tables[:, :1].expand(b, hkv, w)  # one list for every KV head (stride 0)
            decode._triton_paged_decode(q, pools, pools, shared, nblocks, tail, 1.0, None, decode._empty)
    _check_variants(launches, decode.LOOSE, {"split": 2, "merge": 8})
    warmed = _record(monkeypatch, decode, {"split": decode._split_kernel, "merge": decode._merge_kernel})
    decode.warm_decode(torch.zeros(1, hkv * group, d), pools, pools, 4096)
    assert warmed["split"].constants == launches["split"].constants
    assert warmed["merge"].constants == launches["merge"].constants


def test_selection_kernels_compile_a_handful_of_variants_whatever_the_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The selection kernels over sessions of 1 to 4,096 blocks, batches of 1 to 16, anchors of 1
    to 40 and digest arenas of growing rows: the integer arguments that vary are all unspecialized;
    the `constexpr` paddings (the table's and the lists' widths, the anchors') take one value per
    power of two."""
    from h3d.kernels import select

    fns = {"scores": select._scores_kernel, "top": select._top_kernel, "lists": select._lists_kernel,
           "fold": select._fold_kernel}  # fmt: skip
    launches = _record(monkeypatch, select, fns)
    hkv, group, d, parts, k = 8, 4, 128, 2, 64
    for b in (1, 2, 16):
        for w in (1, 15, 16, 17, 100, 513, 1000, 4096):  # (`ws` below)
            for a in (1, 7, 40):
                arena = torch.zeros(hkv, parts * (w + 1) + a, 2, d)  # its rows grow with the sessions
                zeros = torch.zeros(b, dtype=torch.int64)
                out = torch.zeros(b, hkv, w)
                q = torch.zeros(b, hkv * group, d)
                anchors = torch.zeros(b, hkv, a, dtype=torch.int64)
                select.scores(out, q, arena, parts, zeros, zeros, zeros, zeros, anchors, 1, 2)
                top = select.top_room(out, zeros, min(k, w))
                width = w + a
                heads = torch.zeros(b, hkv, width, dtype=torch.int32)
                picked = torch.zeros(b, hkv, 3 + top.shape[2], dtype=torch.int64)
                table = torch.zeros(b, w, dtype=torch.int32)
                nblocks = torch.zeros(b, hkv, dtype=torch.int32)
                select.lists(top, table, zeros, zeros, heads, nblocks, picked, 1, 2)
                select.fold(arena, zeros, torch.zeros(b, hkv, d))
    pad = loader.load().triton.next_power_of_2
    ws, ks = (1, 15, 16, 17, 100, 513, 1000, 4096), (1, 7, 40)
    most = {"scores": len({max(16, pad(a)) for a in ks}), "top": len({pad(w) for w in ws}),
            "lists": len({pad(max(w + a, 3 + min(k, w))) for w in ws for a in ks}), "fold": 1}  # fmt: skip
    _check_variants(launches, select.LOOSE, most)
