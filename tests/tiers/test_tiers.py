"""The KV tiers (HBM pool, DDR pool, SSD archive) end to end.

- Round trip: a block written to HBM, demoted to DDR, archived, staged back into another DDR slot
  and promoted into another HBM slot comes back bit-identical with raw-zstd, within the documented
  bound with int8-delta-zstd.
- Tiered = untiered: sessions whose KV is far larger than HBM (blocks read in place from DDR,
  staged from the archive layer by layer) give the same tokens and, teacher-forced, the same
  logits as with every block in HBM; the tier invariants hold after every step; the counters show
  the tiers were used (and were not, with room to spare).
- Failures: a corrupt archive record is named by `get` and by the step that needs it; an archive
  of another model is refused; a session that does not fit is refused at admission and harms no
  other; idle sessions are demoted to make room and lose nothing.
- Slow: the embedded SmolLM2 on 2,000 tokens of real text, with 10% of its KV in HBM.

The crash between an archive's data and manifest writes is covered by
tests/tiers/test_archive.py::test_crash_between_data_and_manifest.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    VOCAB_SIZE,
    assert_greedy_match,
    flip_payload_byte,
    make_engine,
    random_prompt,
    split_sizes,
    teacher_margins,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from h3d.config import EngineConfig
from h3d.daemon.convert import stats_pb
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import GenerationDone, RequestFailed, SessionId, TokenDelta
from h3d.engine.step import Chunk, StepPlan, StepReport
from h3d.errors import H3Error, OutOfBlocks, SessionNotFound, SsdDegraded
from h3d.kv.blocks import NONE, SeqId
from h3d.kv.entries import NULL_ENTRY
from h3d.kv.pool import KVPool
from h3d.tiers import lifecycle
from h3d.tiers.archive import Archive
from h3d.tiers.codecs import INT8_MAX_REL_ERROR, INT8_MIN_SCALE, Codec
from h3d.tiers.identity import ArchiveCorrupt, ArchiveError, ArchiveMismatch, BlockKey, CacheIdentity
from h3d.tiers.manager import torch_equal
from h3d.tiers.mover import Mover
from h3d.tiers.stats import TierStats

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama_gqa4_tied"  # 3 layers, 2 KV heads of 16: 768 bytes of fp32 K+V per token
BS = 16
SLOT_BYTES = 2 * BS * 2 * 16 * 4  # one layer's K+V of one block: 4 KiB


def kv_bytes_per_token(engine: Engine) -> int:
    mc = engine.model.config
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4


# ---- (a) round trip through every tier -------------------------------------------------------

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
HUGE = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 6e4}
TINY = {torch.float32: 1e-40, torch.bfloat16: 1e-40, torch.float16: 1e-7}  # denormal in each dtype


def _values(shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    """[n, Hkv, D] values of one magnitude class, with +0 and -0 sprinkled in; 'bits' is any bit
    pattern (inf, NaN payloads, denormals)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "bits":
        info = torch.iinfo(BITS[dtype])
        x = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(BITS[dtype]).view(dtype)
        specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
        x.view(-1)[: min(5, x.numel())] = specials[: x.numel()]
        return x
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "huge":
        x = x.clamp(-1, 1) * HUGE[dtype]
    elif kind == "tiny":
        x = x * TINY[dtype]
    elif kind == "mixed":  # each token row (one head's D values) has its own magnitude
        x = x * 10.0 ** torch.randint(-6, 7, (*shape[:-1], 1), generator=g).to(torch.float64)
    elif kind == "zeros":
        x = torch.zeros(shape, dtype=torch.float64)
    x = x.clamp(-HUGE[dtype], HUGE[dtype]).to(dtype)
    x[torch.rand(shape, generator=g) < 0.1] = 0.0
    x[torch.rand(shape, generator=g) < 0.05] = -0.0
    return x


@dataclass(frozen=True)
class Case:
    codec: Codec
    dtype: torch.dtype
    hkv: int
    bs: int
    d: int
    n: int  # tokens written into the block (1..bs)
    k: torch.Tensor  # [n, Hkv, D]
    v: torch.Tensor


@st.composite
def cases(draw: st.DrawFn) -> Case:
    codec = draw(st.sampled_from(list(Codec)))
    dtype = draw(st.sampled_from(list(NAMES)))
    hkv, bs, d = draw(st.integers(1, 4)), draw(st.sampled_from([1, 4, 16, 32])), draw(st.sampled_from([8, 16, 64]))
    n = draw(st.integers(1, bs))
    kinds = ["unit", "huge", "tiny", "mixed", "zeros"] + (["bits"] if codec is Codec.RAW_ZSTD else [])
    kind, seed = draw(st.sampled_from(kinds)), draw(st.integers(0, 2**31 - 1))
    shape = (n, hkv, d)
    return Case(codec, dtype, hkv, bs, d, n, _values(shape, dtype, kind, seed), _values(shape, dtype, kind, seed + 1))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _check_int8(x: torch.Tensor, y: torch.Tensor) -> None:
    """Per token row (one head's D values of one token), |x - x̂| <= max|row| * INT8_MAX_REL_ERROR.

    Plus the roundings the codec documents: float32 arithmetic (2^-22 of the row max); the cast of
    x̂ back to the pool's dtype, half an ulp of x̂ (eps/2 of |x̂| <= eps/2 * max|row| * (1 + 1/254):
    2^-8 for bf16, which is as large as the quantization step itself, 2^-11 for fp16, 2^-24 for
    fp32), or half the smallest denormal where x̂ underflows; rows below 127 * INT8_MIN_SCALE use
    that scale (absolute error INT8_MIN_SCALE / 2). All-zero rows come back as zeros.
    """
    info = torch.finfo(x.dtype)
    x64, y64 = x.double(), y.double()  # [n, Hkv, D]
    amax = x64.abs().amax(dim=-1, keepdim=True)  # [n, Hkv, 1]
    quant = torch.clamp(amax * INT8_MAX_REL_ERROR, min=INT8_MIN_SCALE / 2)
    rounding = amax * (2.0**-22 + info.eps / 2 * (1 + INT8_MAX_REL_ERROR)) + info.smallest_normal * info.eps / 2
    err = (x64 - y64).abs()
    assert bool((err <= quant + rounding).all()), f"max excess {(err - quant - rounding).max().item():.3g}"
    big = amax[..., 0] > 127 * INT8_MIN_SCALE
    rel = (err.amax(dim=-1) / amax[..., 0].clamp(min=1e-300))[big]  # [rows]
    limit = INT8_MAX_REL_ERROR + 2.0**-22 + info.eps / 2 * (1 + INT8_MAX_REL_ERROR)
    assert bool((rel <= limit + 1e-12).all()), f"per-row relative error {rel.max().item():.5f} > {limit:.5f}"
    assert bool((y64[amax.expand_as(x64) == 0] == 0).all()), "an all-zero row did not decode to zeros"


def _pools(seed: int) -> tuple[KVPool, KVPool]:
    cpu = torch.device("cpu")
    hbm, ddr = KVPool(6, 4, 2, 8, torch.float32, cpu), KVPool(8, 4, 2, 8, torch.float32, cpu)
    g = torch.Generator().manual_seed(seed)
    for pool in (hbm, ddr):
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
    return hbm, ddr


def _promotion_copies(mover: Mover) -> None:
    """Two sessions' promotions as `Promoter.promote` makes them: victims copied down, promoted
    blocks copied up into their slots (and a free slot)."""
    mover.hbm_to_ddr(np.array([1, 2]), np.array([5, 6]))  # session a's victims
    mover.ddr_to_hbm(np.array([0, 3]), np.array([1, 2]))  # a's promoted blocks, into their slots
    mover.hbm_to_ddr(np.array([4]), np.array([7]))  # session b's victim
    mover.ddr_to_hbm(np.array([4, 1]), np.array([4, 5]))  # b's: into the victim's slot and a free one


def test_batched_copies_move_the_same_bytes_as_one_call_each() -> None:
    """`Mover.batched` makes every copy down, then every copy up, in two launches: the bytes of
    both pools end as the copies made one by one leave them, where a copy up writes the HBM slot a
    copy down of the same batch read; a nested block joins the outer one, and an error inside the
    block still makes the copies (the tables already say the bytes moved)."""
    want_hbm, want_ddr = _pools(3)
    _promotion_copies(Mover(want_hbm, want_ddr, None))
    hbm, ddr = _pools(3)
    mover = Mover(hbm, ddr, None)
    with mover.batched():
        with mover.batched():
            _promotion_copies(mover)
        assert torch.equal(hbm.k, _pools(3)[0].k), "a copy was made before the outer block ended"
    for got, want in ((hbm, want_hbm), (ddr, want_ddr)):
        assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)
    hbm, ddr = _pools(3)
    mover = Mover(hbm, ddr, None)
    with pytest.raises(RuntimeError), mover.batched():
        _promotion_copies(mover)
        raise RuntimeError("a failure after the tables changed")
    assert torch.equal(hbm.k, want_hbm.k) and torch.equal(ddr.v, want_ddr.v)
    assert mover.copied == {"down": 3, "up": 4}  # each block counted once, by its direction, batched or not
    one_by_one = Mover(*_pools(3), None)
    _promotion_copies(one_by_one)
    assert one_by_one.copied == {"down": 3, "up": 4}


@settings(max_examples=80, deadline=None)
@given(cases())
def test_round_trip_through_every_tier(case: Case) -> None:
    c = case
    cpu = torch.device("cpu")
    hbm = KVPool(4, c.bs, c.hkv, c.d, c.dtype, cpu)
    ddr = KVPool(5, c.bs, c.hkv, c.d, c.dtype, cpu)
    with tempfile.TemporaryDirectory() as folder:
        identity = CacheIdentity("f00d", NAMES[c.dtype], c.bs, c.hkv, c.d)
        archive = Archive(Path(folder), identity, c.codec)
        mover = Mover(hbm, ddr, archive)
        try:
            key = BlockKey("session", 2, 5)
            hbm.write(torch.arange(c.n) + 1 * c.bs, c.k, c.v)  # HBM slot 1, as the runner writes tokens
            mover.hbm_to_ddr(np.array([1]), np.array([2]))  # demote into DDR slot 2
            assert bool(torch.equal(_bytes(ddr.k[:, 2, : c.n]), _bytes(hbm.k[:, 1, : c.n])))
            assert bool(torch.equal(_bytes(ddr.v[:, 2, : c.n]), _bytes(hbm.v[:, 1, : c.n])))
            mover.write_now([key], ddr, np.array([2]), [c.n])  # archive from DDR, durable
            assert archive.contains(key)
            mover.read([key], np.array([4]))  # stage into another DDR slot
            mover.ddr_to_hbm(np.array([4]), np.array([3]))  # promote into another HBM slot
            k, v = hbm.k[:, 3, : c.n].transpose(0, 1), hbm.v[:, 3, : c.n].transpose(0, 1)  # [n, Hkv, D]
        finally:
            mover.close()
            archive.close()
    assert k.dtype == c.dtype and k.shape == c.k.shape
    if c.codec is Codec.RAW_ZSTD:
        assert bool(torch.equal(_bytes(k), _bytes(c.k))), "K changed on its way through the tiers"
        assert bool(torch.equal(_bytes(v), _bytes(c.v))), "V changed on its way through the tiers"
    else:
        _check_int8(c.k, k)
        _check_int8(c.v, v)


def test_an_archive_read_writes_its_slots_only_once_the_device_passed_its_fence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read takes its fence when it is asked for and waits for it after the records are read
    and decoded, before the first byte lands in a slot (which kernels queued earlier may still
    read in place): on one thread or several, and on a read-ahead thread (`read_into`), whose
    fence its caller took. On a CPU the fence is empty."""
    from h3d.tiers import mover as mover_mod

    cpu = torch.device("cpu")
    hbm, ddr = KVPool(2, 4, 2, 8, torch.float32, cpu), KVPool(40, 4, 2, 8, torch.float32, cpu)
    archive = Archive(tmp_path, CacheIdentity("f00d", "fp32", 4, 2, 8))
    mover = Mover(hbm, ddr, archive)
    assert mover.fence() == []
    keys = [BlockKey("s", 0, i) for i in range(30)]
    k, v = torch.randn(2, 30, 4, 8), torch.randn(2, 30, 4, 8)
    archive.put([(key, k[:, i], v[:, i]) for i, key in enumerate(keys)])
    log: list[tuple[str, str]] = []  # (thread, what)
    mine: dict[str, list[BlockKey]] = {}  # the keys each thread read

    class Fence:
        def synchronize(self) -> None:  # this thread's slots still hold what they held
            name = threading.current_thread().name
            slots = [1 + keys.index(key) for key in mine[name]]
            assert not ddr.k[:, slots].any() and not ddr.v[:, slots].any()
            log.append((name, "passed"))

    get_bytes = archive.get_bytes

    def read(some: list[BlockKey]) -> Any:
        name = threading.current_thread().name
        mine[name] = some
        log.append((name, "read"))
        return get_bytes(some)

    monkeypatch.setattr(archive, "get_bytes", read)
    monkeypatch.setattr(mover, "fence", lambda: [Fence()])
    for n in (3, 30):  # one piece on this thread; pieces on the readers
        ddr.k.zero_(), ddr.v.zero_(), log.clear()
        mover.read(keys[:n], np.arange(1, n + 1))
        for name in {t for t, _ in log}:  # each piece: read, then past its fence, then written
            seen = [what for t, what in log if t == name]
            assert seen == ["read", "passed"] * (len(seen) // 2)
        per = min(mover_mod.READ_PIECE, max(mover_mod.MIN_READ_PIECE, -(-n // mover_mod.READ_THREADS)))
        assert len(log) == 2 * -(-n // per) and (n == 3) == (len(log) == 2)  # its pieces, each read once
        assert torch.equal(ddr.k[:, 1 : n + 1], k[:, :n]) and torch.equal(ddr.v[:, 1 : n + 1], v[:, :n])
    ddr.k.zero_(), ddr.v.zero_(), log.clear()
    mover.read_into(keys[:5], np.arange(1, 6), [Fence()])
    assert [what for _, what in log] == ["read", "passed"] and torch.equal(ddr.k[:, 1:6], k[:, :5])
    mover.close()
    archive.close()


# ---- (b, d, h) tiered = untiered on a tiny checkpoint ----------------------------------------

PROMPTS = [random_prompt(n, VOCAB_SIZE, seed=10 + i) for i, n in enumerate([200, 150, 120])]
GEN = 40
GREEDY = SamplingParams(max_tokens=GEN, ignore_eos=True)
TOTAL_TOKENS = sum(len(p) for p in PROMPTS) + len(PROMPTS) * GEN


def run_together(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[int, ...]]:
    """Submit every prompt in a session of its own, step until all are done; each one's tokens."""
    sids = [engine.create_session() for _ in prompts]
    rids = {engine.submit(s, token_ids=p, params=params): i for i, (s, p) in enumerate(zip(sids, prompts, strict=True))}
    out: dict[int, tuple[int, ...]] = {}
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, GenerationDone):
                out[rids[event.request_id]] = event.token_ids
    return [out[i] for i in range(len(prompts))]


def teacher_forced(engine: Engine, ids: list[list[int]], prompt_lens: list[int], chunk: int) -> list[torch.Tensor]:
    """Feed every sequence through the runner together, as the engine would: prompts in chunks of
    `chunk` tokens, then one token per step. Returns each sequence's logits of every token [n, V]."""
    runner = engine.runner
    seqs = [SeqId(500 + i) for i in range(len(ids))]
    for s in seqs:
        runner.kv.open(s)
    plans = [
        split_sizes(p, [chunk] * (p // chunk + 1)) + [1] * (len(x) - p) for x, p in zip(ids, prompt_lens, strict=True)
    ]
    pos = [0] * len(ids)
    outs: list[list[torch.Tensor]] = [[] for _ in ids]
    for step in range(max(len(p) for p in plans)):
        chunks, who = [], []
        for i, plan in enumerate(plans):
            if step < len(plan):
                n = plan[step]
                chunks.append(Chunk(seqs[i], tuple(ids[i][pos[i] : pos[i] + n]), pos[i], True))
                who.append((i, n))
                pos[i] += n
        logits = runner.step(chunks, all_logits=True)
        start = 0
        for i, n in who:
            outs[i].append(logits[start : start + n])
            start += n
    for s in seqs:
        runner.kv.release(s)
    return [torch.cat(o) for o in outs]


@dataclass
class TieredRun:
    want: list[tuple[int, ...]]  # tokens with every block in HBM
    got: list[tuple[int, ...]]  # tokens with the tiers
    big: Engine
    tiered: Engine
    big_stats: TierStats
    tiered_stats: TierStats
    hbm_mb: float
    steps_checked: int


@pytest.fixture(scope="module")
def tiered_run(checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[TieredRun]:
    model = checkpoint(MODEL)
    big = make_engine(model, prefill_chunk_tokens=64, hbm_mb=64.0, ddr_mb=1.0)
    per_token = kv_bytes_per_token(big)
    # HBM: 15% of the three sessions' KV (5 blocks per layer). DDR: 40% of it. Every layer of a
    # decode step reads all three sessions' blocks of that layer at once (37 per layer at the end),
    # from HBM (5) or DDR, and DDR also holds the partial last blocks of the other layers; 30%
    # would not fit them (see test_a_batch_that_does_not_fit_fails_cleanly).
    hbm_mb = per_token * TOTAL_TOKENS * 0.15 / 2**20
    ddr_mb = per_token * TOTAL_TOKENS * 0.40 / 2**20
    tiered = make_engine(
        model,
        prefill_chunk_tokens=64,
        hbm_mb=hbm_mb,
        ddr_mb=ddr_mb,
        ssd_path=str(tmp_path_factory.mktemp("ssd")),
        ssd_codec="raw-zstd",
        check_invariants=True,
    )
    assert tiered.runner.blocks.slots_per_layer >= 1
    checks = 0
    check = tiered.runner.tiers.check

    def counted() -> None:
        nonlocal checks
        checks += 1
        check()

    tiered.runner.tiers.check = counted  # type: ignore[method-assign]
    want = run_together(big, PROMPTS, GREEDY)
    got = run_together(tiered, PROMPTS, GREEDY)
    yield TieredRun(want, got, big, tiered, big.tier_stats(), tiered.tier_stats(), hbm_mb, checks)
    tiered.close()
    big.close()


def test_tiered_generation_equals_untiered(tiered_run: TieredRun) -> None:
    r = tiered_run
    for prompt, got, want in zip(PROMPTS, r.got, r.want, strict=True):
        assert len(got) == len(want) == GEN
        margins = teacher_margins(r.big, prompt, want)
        assert_greedy_match(got, want, margins, min_compared=GEN)  # every step had a clear argmax
        assert got == want
    s = r.tiered_stats
    assert s.ssd_read_count > 0 and s.ssd_write_count > 0, "the archive was never used"
    assert s.hbm_hit_rate < 1 and s.ddr_hits > 0 and s.fetch_bytes > 0, "HBM held everything"
    assert s.hbm_capacity_bytes <= 0.15 * kv_bytes_per_token(r.tiered) * TOTAL_TOKENS


def test_tier_invariants_were_checked_after_every_step(tiered_run: TieredRun) -> None:
    """check_invariants=True runs TierManager.check() (bookkeeping, and HBM/DDR/SSD copies of a
    block holding the same bytes) after every forward; every step of the run passed it."""
    steps = GEN + max(-(-len(p) // 64) for p in PROMPTS) - 1  # prefill chunks, then one decode step each
    assert tiered_run.steps_checked >= steps
    tiered_run.tiered.runner.tiers.check()


def test_tier_counters(tiered_run: TieredRun) -> None:
    s, b = tiered_run.tiered_stats, tiered_run.big_stats
    assert 0 < s.peak_hbm_bytes <= s.hbm_capacity_bytes
    assert s.hbm_used_bytes <= s.hbm_capacity_bytes and s.ddr_used_bytes <= s.ddr_capacity_bytes
    assert s.ssd_used_bytes > 0
    assert s.hbm_hits + s.hbm_misses == b.hbm_hits + b.hbm_misses, "both runs read the same blocks"
    assert s.hbm_misses == s.ddr_hits + s.ssd_read_count
    assert s.fetch_bytes == s.hbm_misses * SLOT_BYTES
    # With room to spare, every block read was in HBM and nothing moved.
    assert b.hbm_hit_rate == 1.0 and b.hbm_misses == 0 and b.fetch_bytes == 0
    assert b.ssd_read_count == b.ssd_write_count == b.hbm_evict_count == b.ddr_evict_count == 0
    assert 0 < b.peak_hbm_bytes <= b.hbm_capacity_bytes
    assert tiered_run.tiered.tier_stats().as_dict()["hbm_hit_rate"] == s.hbm_hit_rate


def test_teacher_forced_logits_tiered_equal_untiered(
    tiered_run: TieredRun, checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Logits of every token, fed together through the runner of each engine config: within 1e-5 of
    the logits' scale. They are not bit-identical: a decode step reads a session's blocks as runs
    of slots, and where the runs split (HBM / DDR) changes the order of the fp32 P·V sums; a tier
    bug (a wrong or stale block) moves logits by O(1)."""
    r = tiered_run
    ids = [list(p) + list(w) for p, w in zip(PROMPTS, r.want, strict=True)]
    lens = [len(p) for p in PROMPTS]
    tiered = make_engine(
        checkpoint(MODEL),
        hbm_mb=r.hbm_mb,
        ddr_mb=r.tiered.config.ddr_mb,
        ssd_path=str(tmp_path / "ssd"),
        check_invariants=True,
    )
    got = teacher_forced(tiered, ids, lens, 64)
    want = teacher_forced(r.big, ids, lens, 64)
    assert tiered.tier_stats().ssd_read_count > 0
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        scale = max(1.0, w.abs().max().item())  # about 8 here: 1e-5 of it is ~20 fp32 ulps
        assert (g - w).abs().max().item() <= 1e-5 * scale
    tiered.close()


def test_a_batch_that_does_not_fit_fails_cleanly(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Three sessions, each admitted (each fits HBM + DDR on its own), with a DDR of 30% of their
    KV: a decode step must read all three sessions' blocks of a layer at once, which do not fit.

    The engine may run them (deferring what does not fit) or fail a step, but a failed step must not
    leave tokens counted as cached whose K/V were never written: the next step would attend to
    whatever bytes the pools held. (h3d bug: the step's tokens are appended to the block tables in
    `ModelRunner._prepare`, before the forward; `TierManager.stage` raises OutOfBlocks at some layer
    and nothing rolls the append back, so the next step silently reads unwritten K/V.)
    """
    engine = make_engine(checkpoint(MODEL), prefill_chunk_tokens=64, hbm_mb=1.0, ddr_mb=1.0)
    per_token = kv_bytes_per_token(engine)
    tight = make_engine(
        checkpoint(MODEL),
        prefill_chunk_tokens=64,
        hbm_mb=per_token * TOTAL_TOKENS * 0.15 / 2**20,
        ddr_mb=per_token * TOTAL_TOKENS * 0.30 / 2**20,
        ssd_path=str(tmp_path),
    )
    sids = [tight.create_session() for _ in PROMPTS]
    for s, p in zip(sids, PROMPTS, strict=True):
        tight.submit(s, token_ids=p, params=GREEDY)
    while tight.has_work:
        before = {s: tight.cached_tokens(s) for s in sids}
        try:
            tight.step()
        except H3Error:
            after = {s: tight.cached_tokens(s) for s in sids}
            assert after == before, f"a failed step left unwritten tokens counted as cached: {before} -> {after}"
            break
    tight.close()


# ---- (e) corruption and foreign archives -----------------------------------------------------


def _archive_only_block(engine: Engine, sid: SessionId) -> tuple[int, int]:
    """A (layer, block) of the session whose only copy is in the archive."""
    t = engine.runner.blocks.table(engine.session(sid).seq)
    nb = t.num_blocks
    only = t.archived[:, :nb] & (t.hbm[:, :nb] == NONE) & (t.ddr[:, :nb] == NONE)
    layers, blocks = np.nonzero(only)
    assert len(layers), "no block was left in the archive only; make HBM/DDR smaller"
    return int(layers[-1]), int(blocks[-1])


def _spilled_engine(model: Path, folder: Path) -> tuple[Engine, SessionId, list[int]]:
    """An engine whose one session (300 tokens appended) lives mostly in the archive."""
    engine = make_engine(
        model,
        prefill_chunk_tokens=64,
        hbm_mb=3 * 2 * SLOT_BYTES / 2**20,  # 2 blocks per layer
        ddr_mb=24 * SLOT_BYTES / 2**20,  # of the 57 blocks: at least 25 end up in the archive only
        ssd_path=str(folder),
    )
    sid = engine.create_session()
    prompt = random_prompt(300, VOCAB_SIZE, seed=21)
    engine.append(sid, token_ids=prompt)
    engine.runner.tiers.settle()
    return engine, sid, prompt


def _names_block(message: str, session: str, layer: int, block: int) -> None:
    assert session in message and f"layer {layer}" in message and f"block {block}" in message, message


def test_corrupt_archive_record_is_named(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    engine, sid, _ = _spilled_engine(checkpoint(MODEL), tmp_path)
    layer, block = _archive_only_block(engine, sid)
    archive = engine.runner.tiers.archive
    assert archive is not None
    key = BlockKey(sid, layer, block)
    archive.get(key)  # fine before
    flip_payload_byte(tmp_path, sid, layer, block)
    with pytest.raises(ArchiveCorrupt) as err:
        archive.get(key)
    _names_block(str(err.value), sid, layer, block)
    assert err.value.key == key
    # The engine meets it when the next step stages that block: the reason it rebuilds names it.
    engine.complete(sid, "", SamplingParams(max_tokens=4, ignore_eos=True))
    [reason] = engine.rebuilds
    _names_block(reason, sid, layer, block)
    engine.close()


def test_a_corrupt_block_is_rebuilt_never_read(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A damaged archive record is never used: that block alone is computed again from its tokens,
    in every layer, over the blocks before it (counted in kv_rebuild_blocks), and its K/V and the
    next generation equal an undamaged twin's. The step that met it leaves no trace."""
    engine, sid, _ = _spilled_engine(checkpoint(MODEL), tmp_path / "damaged")
    twin, twin_sid, _ = _spilled_engine(checkpoint(MODEL), tmp_path / "twin")
    layer, block = _archive_only_block(engine, sid)
    flip_payload_byte(tmp_path / "damaged", sid, layer, block)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    rid = engine.submit(sid, params=params)
    cached = engine.cached_tokens(sid)
    assert not any(isinstance(e, RequestFailed) for e in engine.step())  # the request goes on
    seq = engine.session(sid).seq
    t = engine.runner.blocks.table(seq)
    assert engine.cached_tokens(sid) == cached  # nothing else is dropped
    assert ((t.hbm[:, block] != NONE) | (t.ddr[:, block] != NONE)).all() and not t.archived[:, block].any()
    assert engine.tier_stats().kv_rebuild_blocks == 1
    [reason] = engine.rebuilds
    _names_block(reason, sid, layer, block)
    twin_seq = twin.session(twin_sid).seq
    for layer_ in range(engine.runner.blocks.num_layers):
        mine = engine.runner.tiers.read_keys(seq, layer_)
        theirs = twin.runner.tiers.read_keys(twin_seq, layer_)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    tokens: list[int] = []
    while engine.has_work:
        tokens += [e.token_id for e in engine.step() if isinstance(e, TokenDelta) and e.request_id == rid]
    assert tokens == list(twin.complete(twin_sid, "", params).token_ids)
    engine.runner.tiers.check()
    engine.close()
    twin.close()


def test_restart_writes_the_next_token_into_the_archived_partial_block(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """After a checkpoint and a restart, the partial last block is only in the archive; the first
    token fed is written into it (brought back to DDR first), so every layer's keys equal those of
    an engine that never stopped."""
    cfg = {"ssd_path": str(tmp_path / "archive"), "session_log_path": str(tmp_path / "sessions")}
    engine = make_engine(checkpoint(MODEL), **cfg)
    twin = make_engine(checkpoint(MODEL))
    prompt = random_prompt(299, VOCAB_SIZE, seed=3)  # 18 full blocks of 16 and 11 tokens
    sid = engine.create_session()
    engine.append(sid, token_ids=prompt)
    engine.checkpoint()
    engine.close()
    restored = make_engine(checkpoint(MODEL), **cfg)
    twin_sid = twin.create_session()
    twin.append(twin_sid, token_ids=prompt)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert restored.complete(sid, "", params).token_ids == twin.complete(twin_sid, "", params).token_ids
    seq, twin_seq = restored.session(sid).seq, twin.session(twin_sid).seq
    for layer in range(restored.runner.blocks.num_layers):
        mine = restored.runner.tiers.read_keys(seq, layer)
        theirs = twin.runner.tiers.read_keys(twin_seq, layer)
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    restored.runner.tiers.check()
    restored.close()
    twin.close()


def test_several_corrupt_blocks_are_each_rebuilt(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Five damaged records in five blocks (some met while rewriting a later one): exactly those
    five blocks are computed again, and the logits equal an undamaged twin's."""
    engine, sid, _ = _spilled_engine(checkpoint(MODEL), tmp_path / "damaged")
    twin, twin_sid, _ = _spilled_engine(checkpoint(MODEL), tmp_path / "twin")
    seq = engine.session(sid).seq
    t = engine.runner.blocks.table(seq)
    full = engine.cached_tokens(sid) // engine.runner.blocks.block_size
    only = (t.hbm[:, :full] == NONE) & (t.ddr[:, :full] == NONE) & t.archived[:, :full]
    damaged: dict[int, int] = {}  # block -> a layer where it is archive-only
    for layer_, block_ in zip(*np.nonzero(only), strict=True):
        damaged.setdefault(int(block_), int(layer_))
    assert len(damaged) >= 5, "make HBM/DDR smaller"
    picked = sorted(damaged)[-5:]
    for block_ in picked:
        flip_payload_byte(tmp_path / "damaged", sid, damaged[block_], block_)
    tokens = list(engine.session(sid).tokens)
    got_tokens, got = _greedy_with_logits(engine, sid)
    want_tokens, want = _greedy_with_logits(twin, twin_sid)
    assert engine.tier_stats().kv_rebuild_blocks == 5
    assert sorted(int(r.split("block ")[-1].split()[0]) for r in engine.rebuilds) == picked
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert engine.session(sid).tokens[: len(tokens)] == tokens
    engine.runner.tiers.check()
    engine.close()
    twin.close()


def _greedy_with_logits(engine: Engine, sid: SessionId, n: int = 8) -> tuple[list[int], torch.Tensor]:
    """`n` greedy tokens and the logits each was sampled from (the engine repairs damaged blocks
    as its steps meet them)."""
    rows: list[torch.Tensor] = []
    execute = engine.runner.execute

    def spy(plan: StepPlan, all_logits: bool = False) -> StepReport:
        report = execute(plan, all_logits)
        rows.extend(report.logits)
        return report

    engine.runner.execute = spy  # type: ignore[method-assign]
    done = engine.complete(sid, "", SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    engine.runner.execute = execute  # type: ignore[method-assign]
    return list(done.token_ids), torch.stack(rows)


def test_archive_of_another_model_is_refused(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    first = make_engine(checkpoint(MODEL), ssd_path=str(tmp_path))
    first.close()
    # linear_rope has the same KV geometry (2 KV heads of 16, fp32, blocks of 16): only the
    # model fingerprint tells the two apart.
    with pytest.raises(ArchiveMismatch, match="fingerprint"):
        make_engine(checkpoint("linear_rope"), ssd_path=str(tmp_path))
    again = make_engine(checkpoint(MODEL), ssd_path=str(tmp_path))  # the refusal released the store
    again.close()


# ---- (g) admission and demotion --------------------------------------------------------------


def test_admission_refuses_what_the_tiers_cannot_hold(checkpoint: Callable[[str], Path]) -> None:
    """No SSD tier: a session whose prompt does not fit next to the stored one is refused at
    submit; the stored session (partly in DDR) keeps its tokens and KV and continues as alone."""
    model = checkpoint(MODEL)
    config = {"hbm_mb": 3 * 4 * SLOT_BYTES / 2**20, "ddr_mb": 9 * SLOT_BYTES / 2**20}  # 4 + 3 blocks per layer
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    first_prompt = random_prompt(90, VOCAB_SIZE, seed=31)  # 6 blocks per layer with its 10 tokens
    alone = make_engine(model, **config)
    sid_alone = alone.create_session()
    alone.append(sid_alone, token_ids=first_prompt)
    want = alone.complete(sid_alone, "", params).token_ids

    engine = make_engine(model, **config)
    first = engine.create_session()
    engine.append(first, token_ids=first_prompt)
    t = engine.runner.blocks.table(engine.session(first).seq)
    assert (t.ddr[:, : t.num_blocks] != NONE).any(), "the first session should reach into DDR"
    tables = (t.hbm.copy(), t.ddr.copy())
    kv = (engine.runner.hbm.k.clone(), engine.runner.hbm.v.clone(), engine.runner.ddr.k.clone())
    second = engine.create_session()
    with pytest.raises(OutOfBlocks):
        engine.submit(second, token_ids=random_prompt(40, VOCAB_SIZE, seed=32), params=params)
    assert not engine.has_work and engine.session(second).tokens == []
    assert np.array_equal(t.hbm, tables[0]) and np.array_equal(t.ddr, tables[1])
    # bitwise: the pools' unwritten slots hold whatever the memory held (NaN patterns included)
    assert torch_equal(engine.runner.hbm.k, kv[0]) and torch_equal(engine.runner.hbm.v, kv[1])
    assert torch_equal(engine.runner.ddr.k, kv[2])
    assert engine.complete(first, "", params).token_ids == want
    engine.runner.tiers.check()


@pytest.mark.parametrize("ddr_slots", [24, 12], ids=["ddr_roomy", "ddr_tight"])
def test_idle_sessions_are_demoted_and_lose_nothing(
    checkpoint: Callable[[str], Path], tmp_path: Path, ddr_slots: int
) -> None:
    """HBM full of an idle session: a new session's prefill demotes the idle one's blocks, and both
    sessions generate what they would alone.

    The idle session holds 6 blocks per layer in HBM and 1 in DDR; the new one's prefill needs 5
    per layer. ddr_roomy: DDR takes the 15 demoted blocks. ddr_tight: it does not (12 slots, 3
    used), so demoting layer 1 and 2 must first archive the idle session's blocks already demoted
    from layer 0. (h3d bug, ddr_tight: `TierManager._demote_idle` frees DDR with
    `order = [p for p in self._order(batch, None) if p[0] != seq]`, which leaves out every layer of
    the session being demoted, here the only idle one, so `_free_ddr` finds nothing to evict and
    the step fails with OutOfBlocks although an archive is configured. Excluding only the pair
    being demoted, `if p != (seq, layer)`, is enough: the blocks of that pair that already have a
    DDR copy must keep it until `drop_hbm`.)
    """
    model = checkpoint(MODEL)
    config = {
        "hbm_mb": 3 * 6 * SLOT_BYTES / 2**20,  # 6 blocks per layer
        "ddr_mb": ddr_slots * SLOT_BYTES / 2**20,
        "check_invariants": True,
    }
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    p1, p2 = random_prompt(90, VOCAB_SIZE, seed=41), random_prompt(80, VOCAB_SIZE, seed=42)
    more = random_prompt(5, VOCAB_SIZE, seed=43)

    def alone(turns: list[list[int]], folder: Path) -> list[tuple[int, ...]]:
        e = make_engine(model, ssd_path=str(folder), **config)
        s = e.create_session()
        out: list[tuple[int, ...]] = []
        for ids in turns:
            e.append(s, token_ids=ids)
            out.append(e.complete(s, "", params).token_ids)
        e.close()
        return out

    want_a = alone([p1, more], tmp_path / "a")
    want_b = alone([p2], tmp_path / "b")

    engine = make_engine(model, ssd_path=str(tmp_path / "both"), **config)
    a = engine.create_session()
    engine.append(a, token_ids=p1)
    first_a = engine.complete(a, "", params).token_ids  # a fills HBM (6 of its 7 blocks per layer), then idles
    assert engine.runner.blocks.num_free == 0
    b = engine.create_session()
    engine.append(b, token_ids=p2)
    got_b = engine.complete(b, "", params).token_ids
    stats = engine.tier_stats()
    assert stats.hbm_evict_count > 0, "b's prefill should have demoted a's HBM blocks"
    ta = engine.runner.blocks.table(engine.session(a).seq)
    assert (ta.hbm[:, : ta.num_blocks] == NONE).any()
    engine.append(a, token_ids=more)
    second_a = engine.complete(a, "", params).token_ids
    big = make_engine(model)
    for got, want, context in (
        (first_a, want_a[0], p1),
        (got_b, want_b[0], p2),
        (second_a, want_a[1], p1 + list(want_a[0]) + more),
    ):
        assert_greedy_match(got, want, teacher_margins(big, context, want), min_compared=len(want))
        assert got == want
    engine.runner.tiers.check()
    engine.close()


# ---- (c) the real model, slow ----------------------------------------------------------------

SMOL_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # 46080: 30 layers, 3 KV heads of 64, fp32


def _real_text() -> str:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(p.read_text() for p in docs if p.is_file())


@pytest.mark.slow
def test_real_model_tiered_equals_untiered(smol_dir: Path, tmp_path: Path) -> None:
    """The embedded model's 48 greedy tokens after a 2,000-token real-text prompt, with HBM 10 % and
    DDR 30 % of the session's KV (most blocks come back from the archive every step), equal
    untiered decoding's with the lossless codec; the lossy one's agreement is printed."""
    prompt_len, gen = 2000, 48  # each tiered step reads most of the context back from the archive
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    kv = (prompt_len + gen) * SMOL_KV_BYTES_PER_TOKEN

    seconds: list[float] = []

    def run(**overrides: Any) -> tuple[tuple[int, ...], TierStats]:
        start = time.perf_counter()
        engine = Engine(EngineConfig.build(model=str(smol_dir), dtype="fp32", policy="exact", **overrides))
        assert engine.model.config.num_layers * engine.model.config.num_kv_heads * 64 * 8 == SMOL_KV_BYTES_PER_TOKEN
        text, ids = _real_text(), list[int]()
        while len(ids) < prompt_len:
            ids = engine.tokenizer.encode(text)
            text += "\n\n" + text
        ids = ids[:prompt_len]
        sid = engine.create_session()
        done: GenerationDone | None = None
        rid = engine.submit(sid, token_ids=ids, params=params)
        for event in engine.run(rid):
            if isinstance(event, GenerationDone):
                done = event
        assert done is not None
        stats = engine.tier_stats()
        engine.close()
        seconds.append(time.perf_counter() - start)
        return done.token_ids, stats

    tiers = {"hbm_mb": 0.10 * kv / 2**20, "ddr_mb": 0.30 * kv / 2**20}
    want, big_stats = run(hbm_mb=1024.0)
    got, stats = run(**tiers, ssd_path=str(tmp_path / "raw"), ssd_codec="raw-zstd")
    assert big_stats.hbm_hit_rate == 1.0 and big_stats.fetch_bytes == 0
    assert stats.ssd_read_count > 0 and stats.hbm_hit_rate < 1
    assert stats.peak_hbm_bytes <= stats.hbm_capacity_bytes <= 0.10 * kv
    if list(got) != list(want):
        first = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        pytest.fail(f"tiered greedy differs from untiered at token {first} of {gen}")
    lossy, lossy_stats = run(**tiers, ssd_path=str(tmp_path / "int8"), ssd_codec="int8-delta-zstd")
    agree = sum(a == b for a, b in zip(lossy, want, strict=True)) / gen
    prefix = next((i for i, (a, b) in enumerate(zip(lossy, want, strict=True)) if a != b), gen)
    print(
        f"\nint8-delta-zstd: {agree:.1%} of {gen} greedy tokens equal to untiered, first {prefix} identical; "
        f"hbm_hit_rate {stats.hbm_hit_rate:.3f}, ssd reads {stats.ssd_read_count} (raw) / "
        f"{lossy_stats.ssd_read_count} (int8), ssd bytes {stats.ssd_used_bytes} / {lossy_stats.ssd_used_bytes}; "
        f"seconds: untiered {seconds[0]:.0f}, raw {seconds[1]:.0f}, int8 {seconds[2]:.0f}"
    )
    assert agree > 0


@pytest.mark.slow
def test_real_model_damaged_blocks_are_rebuilt_after_a_restart(smol_dir: Path, tmp_path: Path) -> None:
    """A checkpointed session restarts from an archive with 5 damaged records (5 blocks, various
    layers): exactly those blocks are computed again (kv_rebuild_blocks = 5), and the next 8 greedy
    tokens and their logits equal (within 1e-3) a restart from the undamaged archive."""

    def config(folder: Path) -> EngineConfig:
        return EngineConfig.build(
            model=str(smol_dir),
            dtype="fp32",
            policy="exact",
            ssd_path=str(folder / "archive"),
            session_log_path=str(folder / "sessions"),
        )

    engine = Engine(config(tmp_path / "damaged"))
    ids = engine.tokenizer.encode(_real_text())[:500]
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    engine.checkpoint()
    engine.close()
    shutil.copytree(tmp_path / "damaged", tmp_path / "intact")
    blocks = [2, 5, 8, 11, 14]
    for i, block in enumerate(blocks):
        flip_payload_byte(tmp_path / "damaged" / "archive", sid, (7 * i) % 30, block)

    damaged, intact = Engine(config(tmp_path / "damaged")), Engine(config(tmp_path / "intact"))
    got_tokens, got = _greedy_with_logits(damaged, sid)
    want_tokens, want = _greedy_with_logits(intact, sid)
    assert damaged.tier_stats().kv_rebuild_blocks == 5 and intact.tier_stats().kv_rebuild_blocks == 0
    assert sorted(int(r.split("block ")[-1].split()[0]) for r in damaged.rebuilds) == blocks
    assert intact.tier_stats().ssd_read_count > 0
    assert got_tokens == want_tokens
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    damaged.close()
    intact.close()


# ---- (d) a full disk: the SSD tier degrades, serving goes on, and it recovers ---------------------


def test_full_disk_degrades_the_ssd_tier_and_serving_goes_on(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Archive writes fail with ENOSPC: the SSD tier is marked degraded (no request fails, no DDR
    copy is dropped), DDR is freed by forgetting an idle session's KV, which is computed again
    when it is used next (its generation equals an untiered engine's); once writes succeed again
    the tier recovers and archives, and the archive reopens clean."""
    import errno

    from h3d.store.files import FileOps

    disk_full = [True]

    class FullDisk(FileOps):
        def write_all(self, fd: int, data: bytes, offset: int) -> None:
            if disk_full[0]:
                raise OSError(errno.ENOSPC, "No space left on device")
            super().write_all(fd, data, offset)

    engine = make_engine(
        checkpoint(MODEL),
        prefill_chunk_tokens=64,
        hbm_mb=3 * 2 * SLOT_BYTES / 2**20,  # 2 blocks per layer
        ddr_mb=56 * SLOT_BYTES / 2**20,  # one session of 300 tokens (57 blocks) fits, past the watermark
        ssd_path=str(tmp_path / "archive"),
        ssd_retry_interval_s=3600,
    )
    assert engine.runner.tiers.archive is not None
    engine.runner.tiers.archive.files = FullDisk()  # before its first write
    plain = make_engine(checkpoint(MODEL))
    tiers = engine.runner.tiers
    prompts = [random_prompt(300, VOCAB_SIZE, seed=60 + i) for i in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    first = engine.create_session()
    engine.append(first, token_ids=prompts[0])  # past the high watermark: the spill's write fails
    tiers.settle()
    stats = engine.tier_stats()
    assert stats.ssd_degraded and stats.ssd_write_errors >= 1 and stats.ssd_write_count > 0
    assert [name for name, _ in tiers.notices] == ["ssd_degraded"]
    assert "No space left" in str(tiers.ssd_degraded)
    assert engine.cached_tokens(first) == 299 and not tiers.blocks.table(engine.session(first).seq).archived.any()

    second = engine.create_session()
    engine.append(second, token_ids=prompts[1])  # DDR is freed by forgetting the idle first session
    assert engine.tier_stats().recompute_evict_count > 0
    assert engine.cached_tokens(first) < 299 and engine.cached_tokens(second) == 299
    with pytest.raises(SsdDegraded):
        engine.kv.snapshot(engine.session(second).seq)

    for sid, prompt in zip((first, second), prompts, strict=True):
        twin = plain.create_session()
        plain.append(twin, token_ids=prompt)
        assert engine.complete(sid, "", params).token_ids == plain.complete(twin, "", params).token_ids

    disk_full[0] = False  # space is back: the next retry recovers, and spills archive again
    assert tiers.retry_ssd()
    assert not engine.tier_stats().ssd_degraded and tiers.notices[-1][0] == "ssd_recovered"
    written = engine.tier_stats().ssd_write_count
    engine.complete(first, "", params)
    engine.kv.snapshot(engine.session(first).seq)
    assert engine.tier_stats().ssd_write_count > written
    engine.runner.tiers.check()
    archive = engine.runner.tiers.archive
    assert archive is not None
    keys, identity = archive.keys(), archive.identity
    engine.close()
    plain.close()
    with Archive(tmp_path / "archive", identity) as reopened:
        assert reopened.keys() == keys
        for key in keys:
            reopened.get(key)  # every record the manifest lists is whole


# ---- (e) closed sessions, purge and ssd_capacity_mb ------------------------------------------------


def _closing_engine(model: Path, folder: Path, **overrides: Any) -> Engine:
    return make_engine(model, ssd_path=str(folder / "archive"), session_log_path=str(folder / "sessions"), **overrides)


@pytest.mark.parametrize("write_mb", [None, 0])
def test_a_closed_session_leaves_memory_and_reopens_where_it_stopped(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_mb: int | None
) -> None:
    """Closing (without purge) moves the session's KV to the archive only, freeing its HBM and DDR
    slots, in a few durable writes for all its layers (or, with `SNAPSHOT_WRITE_MB` at 0, a block
    a write); its next request reopens it and continues as if it had never closed. Purging
    deletes its archived KV and its log."""
    if write_mb is not None:
        monkeypatch.setattr(lifecycle, "SNAPSHOT_WRITE_MB", write_mb)
    engine = _closing_engine(checkpoint(MODEL), tmp_path)
    mover = engine.runner.tiers.mover
    writes: list[int] = []
    write_now = mover.write_now
    monkeypatch.setattr(mover, "write_now", lambda keys, *a: (writes.append(len(keys)), write_now(keys, *a))[1])
    twin = make_engine(checkpoint(MODEL))
    prompt = random_prompt(299, VOCAB_SIZE, seed=11)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sid, twin_sid = engine.create_session(), twin.create_session()
    engine.append(sid, token_ids=prompt)
    twin.append(twin_sid, token_ids=prompt)
    assert engine.complete(sid, "", params).token_ids == twin.complete(twin_sid, "", params).token_ids
    seq = engine.session(sid).seq
    engine.close_session(sid)
    assert engine.session(sid).closed
    r = engine.kv.residency(seq)
    blocks = engine.runner.blocks
    assert r.hbm == r.ddr == 0 and r.archived == blocks.table(seq).num_blocks * blocks.num_layers
    assert sum(writes) == r.archived
    if write_mb is None:  # full blocks and the partial one, from HBM and DDR: at most four writes
        assert len(writes) <= 4 < blocks.num_layers * 2
    else:
        assert writes == [1] * r.archived
    assert engine.tier_stats().hbm_used_bytes == engine.tier_stats().ddr_used_bytes == 0
    engine.runner.tiers.check()
    engine.close_session(sid)  # closing a closed session changes nothing
    assert engine.complete(sid, "", params).token_ids == twin.complete(twin_sid, "", params).token_ids
    assert not engine.session(sid).closed and engine.tier_stats().kv_rebuild_blocks == 0
    engine.close_session(sid, purge=True)
    archive = engine.runner.tiers.archive
    assert archive is not None and not archive.blocks_of(sid)
    assert not list((tmp_path / "sessions").glob(f"{sid}*"))
    with pytest.raises(SessionNotFound):
        engine.session(sid)
    engine.close()
    twin.close()


def test_a_closed_session_goes_through_a_checkpoint_and_a_restart_unchanged(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A shutdown's checkpoint snapshots every session, closed ones too: a closed session's
    partial last block is in the archive only, and its record is already current (it was once
    written from a DDR slot that did not exist: the last slot's bytes). After the restart the
    session goes on as an uninterrupted twin does."""
    engine = _closing_engine(checkpoint(MODEL), tmp_path)
    twin = make_engine(checkpoint(MODEL))
    prompt = random_prompt(299, VOCAB_SIZE, seed=12)  # a partial last block
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    sid, twin_sid = engine.create_session(), twin.create_session()
    engine.append(sid, token_ids=prompt)
    twin.append(twin_sid, token_ids=prompt)
    engine.close_session(sid)
    other = engine.create_session()  # the last DDR slot holds another session's KV
    engine.append(other, token_ids=random_prompt(600, VOCAB_SIZE, seed=13))
    engine.checkpoint()
    engine.close()
    again = _closing_engine(checkpoint(MODEL), tmp_path)
    assert again.complete(sid, "", params).token_ids == twin.complete(twin_sid, "", params).token_ids
    again.close()
    twin.close()


def test_an_archive_write_from_no_slot_is_refused(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """NONE (-1) as a slot would read the pool's last slot: another block's bytes, in a record that
    checks as sound. The mover refuses it, in bulk and one by one, and writes nothing."""
    engine = _closing_engine(checkpoint(MODEL), tmp_path)
    mover, archive = engine.runner.tiers.mover, engine.runner.tiers.archive
    assert archive is not None
    bs = engine.kv.block_size
    for tokens in ([bs, bs], [bs, 3]):  # (whole blocks go in bulk)
        keys = [BlockKey("s", 0, 0), BlockKey("s", 0, 1)]
        with pytest.raises(ValueError, match="an archive write from no slot"):
            mover.write_now(keys, engine.kv.ddr, np.array([5, NONE]), tokens)
    assert not archive.sessions()
    engine.close()


def test_the_tiers_refuse_kv_they_cannot_hold_once_cold_kv_is_forgotten(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """With an archive, admission counts every session's blocks (once each) against HBM, DDR and
    the archive within ssd_capacity_mb (less its digest snapshots): a request past that first
    forgets closed sessions' KV, coldest first; where nothing cold is left it is refused
    (RESOURCE_EXHAUSTED) before its tokens are logged, where spills would have filled the disk."""
    engine = _closing_engine(checkpoint(MODEL), tmp_path, hbm_mb=0.25, ddr_mb=0.25, ssd_capacity_mb=0.5)
    tiers = engine.runner.tiers
    b = tiers.blocks
    assert tiers.ssd_capacity is not None
    ddr = int(tiers.high_watermark * b.ddr_alloc.size)  # (what DDR holds below its high watermark)
    room = b.hbm_capacity + ddr + tiers.ssd_capacity // tiers.block_bytes  # one-layer blocks

    def tokens(share: float) -> int:  # a prompt whose KV takes `share` of the room
        return int(share * room / b.num_layers) * b.block_size

    cold, hot, late = (engine.create_session() for _ in range(3))
    engine.append(cold, token_ids=random_prompt(tokens(0.5), VOCAB_SIZE, seed=1))
    engine.close_session(cold)
    assert engine.cached_tokens(cold) > 0 and not engine.evictions
    engine.append(hot, token_ids=random_prompt(tokens(0.65), VOCAB_SIZE, seed=2))
    assert engine.evictions == [cold] and engine.cached_tokens(cold) == 0  # forgotten to make room
    assert engine.cached_tokens(hot) == tokens(0.65) - 1
    with pytest.raises(OutOfBlocks, match="the tiers cannot hold"):
        engine.append(late, token_ids=random_prompt(tokens(0.65), VOCAB_SIZE, seed=3))
    assert engine.session(late).tokens == [] and engine.cached_tokens(late) == 0  # nothing logged
    assert b.entries.num_used <= room
    engine.runner.tiers.check()
    engine.close()


def test_a_decode_step_runs_the_oldest_requests_whose_kv_fits_hbm_and_ddr(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Where the sessions' KV is more than HBM and DDR hold (the archive holds the rest), a decode
    step runs the oldest decoding requests whose sessions' KV fits there; the others wait
    (`waiting_for_memory`, queued in Stats) and decode once those end, every request with the
    tokens an untiered engine gives. (Every session in every step read most of its KV back from
    the archive: 11 s a step for 23 sessions of 32K on an H100 host.)"""
    engine = _closing_engine(checkpoint(MODEL), tmp_path, hbm_mb=0.25, ddr_mb=0.25)
    twin = make_engine(checkpoint(MODEL))
    tiers = engine.runner.tiers
    b = tiers.blocks
    memory = b.hbm_capacity + int(tiers.high_watermark * b.ddr_alloc.capacity)  # one-layer blocks
    length = int(0.4 * memory / b.num_layers) * b.block_size  # each session: 0.4 of HBM and DDR
    prompts = [random_prompt(length, VOCAB_SIZE, seed=40 + i) for i in range(3)]
    sids = [engine.create_session() for _ in prompts]
    for sid, ids in zip(sids, prompts, strict=True):
        engine.append(sid, token_ids=ids)
    assert b.entries.num_used > memory  # the archive holds part of it
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rids = [engine.submit(sid, generate=True, params=params) for sid in sids]
    tokens: dict[int, list[int]] = {r: [] for r in rids}
    first: dict[int, int] = {}
    done: dict[int, int] = {}
    step = 0
    while engine.has_work:
        step += 1
        events = engine.step()
        decoding = [r for r in rids if r in engine.requests() and r not in engine.waiting_for_memory]
        if step == 1:  # GetStats counts the request waiting as queued
            state = SimpleNamespace(worker=SimpleNamespace(throughput=lambda: 0.0), started=0.0, draining=False)
            assert stats_pb(state, engine, []).throughput.queued_requests == 1  # type: ignore[arg-type]
        if len(decoding) > 1:
            assert sum(engine.kv.footprint(engine.requests()[r].session.seq) for r in decoding) <= memory
        for event in events:
            if isinstance(event, TokenDelta):
                tokens[event.request_id].append(event.token_id)
                first.setdefault(event.request_id, step)
            elif isinstance(event, GenerationDone):
                done[event.request_id] = step
        assert step < 1000
    assert set(done) == set(rids)
    assert first[rids[2]] > max(done[rids[0]], done[rids[1]])  # the newest waited for both older ones
    assert first[rids[0]] == first[rids[1]]  # which decoded together
    for r, ids in zip(rids, prompts, strict=True):
        t = twin.create_session()
        twin.append(t, token_ids=ids)
        assert tokens[r] == list(twin.complete(t, "", params).token_ids)
    assert not engine.waiting_for_memory
    engine.runner.tiers.check()
    engine.close()


@pytest.mark.parametrize("name", [MODEL, "gemma3_window"])
def test_a_sessions_footprint_counts_the_blocks_it_keeps(checkpoint: Callable[[str], Path], name: str) -> None:
    """`KVCache.footprint`, the blocks a decode step bounds by HBM and DDR, is the blocks its table
    points at in every layer: a sliding-window layer's freed ones behind its floor left out."""
    engine = make_engine(checkpoint(name), window_keep_tokens=0)
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(300, VOCAB_SIZE, seed=5))
    engine.complete(sid, "", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seq = engine.session(sid).seq
    t = engine.runner.blocks.table(seq)
    kept = int((t.ids[:, : t.num_blocks] != NULL_ENTRY).sum())
    assert engine.kv.footprint(seq) == kept
    assert (kept < t.num_blocks * engine.runner.blocks.num_layers) == (name != MODEL)
    engine.close()


@pytest.mark.parametrize("bounded", [True, False])
def test_decoding_more_kv_than_hbm_and_ddr_hold_reads_the_rest_back_and_decodes_the_same(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bounded: bool
) -> None:
    """Six sessions whose KV is 1.25 x HBM and DDR decode together with the tokens an untiered
    engine gives, where the steps are bounded by HBM and DDR (`Engine.waiting_for_memory`).
    Unbounded, a step stages what the archive alone holds, layer by layer, and freeing DDR for it
    lands the spills in flight: one begun before the step (the last append's) left blocks of the
    layer it stages in the archive only. They are counted again and read too (they were not: "a
    block is in neither HBM nor DDR", the step broken); a step that cannot make room for its
    dense layers fails its requests cleanly (OutOfBlocks: here, all six), where bounded they decode."""
    if not bounded:
        monkeypatch.setattr(Engine, "_memory_blocks", lambda self: None)
    kv_mb = 6 * 256 * 3 * SLOT_BYTES / BS / 2**20  # six sessions of 256 tokens, three layers
    engine = _closing_engine(
        checkpoint(MODEL), tmp_path, hbm_mb=0.45 * kv_mb, ddr_mb=0.35 * kv_mb, prefill_chunk_tokens=256,
        block_size=32, check_invariants=False,  # (its passes after each step land the spills in flight)
    )  # fmt: skip
    twin = make_engine(checkpoint(MODEL))
    prompts = [random_prompt(256, VOCAB_SIZE, seed=60 + i) for i in range(6)]
    sids = [engine.create_session() for _ in prompts]
    for sid, ids in zip(sids, prompts, strict=True):
        engine.append(sid, token_ids=ids)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rids = [engine.submit(sid, generate=True, params=params) for sid in sids]
    tokens: dict[int, list[int]] = {r: [] for r in rids}
    failed: dict[int, H3Error] = {}
    reads = engine.tier_stats().ssd_read_count
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, TokenDelta):
                tokens[event.request_id].append(event.token_id)
            elif isinstance(event, RequestFailed):
                failed[event.request_id] = event.error
    assert engine.tier_stats().ssd_read_count > reads  # (the archive held part of what they read)
    assert all(isinstance(e, OutOfBlocks) for e in failed.values())  # (unbounded: here, every one of them)
    assert not failed or not bounded
    for r, ids in zip(rids, prompts, strict=True):
        if r not in failed:
            t = twin.create_session()
            twin.append(t, token_ids=ids)
            assert tokens[r] == list(twin.complete(t, "", params).token_ids)
    engine.runner.tiers.check()
    engine.close()


def test_ssd_capacity_evicts_closed_sessions_coldest_first_and_reclaims_disk(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Past ssd_capacity_mb of live archive records, the archived KV of closed sessions goes, least
    recently used first; a compaction on the archive's own thread gives the disk space back; an
    evicted session reopens by computing its KV again from its tokens, with the same output."""
    engine = _closing_engine(checkpoint(MODEL), tmp_path)
    prompts = [random_prompt(299, VOCAB_SIZE, seed=80 + i) for i in range(3)]
    sids = []
    for ids in prompts:
        sid = engine.create_session()
        engine.append(sid, token_ids=ids)
        engine.close_session(sid)
        sids.append(sid)
    archive = engine.runner.tiers.archive
    assert archive is not None
    per_session = archive.live_bytes() / 3
    disk = archive.disk_bytes()
    engine.close()

    capacity_mb = 2.5 * per_session / 2**20  # two closed sessions fit, not three
    engine = _closing_engine(checkpoint(MODEL), tmp_path, ssd_capacity_mb=capacity_mb)
    archive = engine.runner.tiers.archive
    assert archive is not None
    for sid in sids[1:]:
        engine.session(sid).last_used_at += 1  # sids[0] is the coldest
    extra = engine.create_session()
    engine.append(extra, token_ids=random_prompt(40, VOCAB_SIZE, seed=7))
    engine.close_session(extra)  # triggers the check
    assert engine.evictions == [sids[0]]
    assert archive.live_bytes() <= capacity_mb * 2**20
    assert archive.wait_compactions(60) and archive.compaction_stats().runs == 1  # on the archive's thread
    assert archive.disk_bytes() < disk
    assert not archive.blocks_of(sids[0]) and archive.blocks_of(sids[1]) and archive.blocks_of(sids[2])
    assert engine.cached_tokens(sids[0]) == 0 and engine.session(sids[0]).closed
    twin = make_engine(checkpoint(MODEL))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for sid, ids in zip(sids, prompts, strict=True):
        t = twin.create_session()
        twin.append(t, token_ids=ids)
        assert engine.complete(sid, "", params).token_ids == twin.complete(t, "", params).token_ids
    engine.runner.tiers.check()
    keys = archive.keys()
    engine.close()
    twin.close()
    with Archive(tmp_path / "archive", archive.identity) as reopened:  # compaction left a clean store
        assert reopened.keys() == keys
        for key in keys:
            reopened.get(key)


@pytest.mark.parametrize("crash", ["before the manifest", "before the old segments go", None])
def test_compaction_keeps_the_store_whatever_point_it_stops_at(tmp_path: Path, crash: str | None) -> None:
    """Compaction copies live records to a new segment, renames a rewritten manifest over the old
    one, then deletes the old segments. Stopped before the rename or before the deletes (a crash),
    or run through, the reopened store holds the same blocks with the same bytes, and the dead
    records' space is gone once it completes."""
    identity = CacheIdentity("f00d", "fp32", 16, 2, 16)
    g = torch.Generator().manual_seed(3)
    blocks = {BlockKey(f"s{s}", layer, i): torch.randn(2, 2, 16, 16, generator=g) for s in range(3)
              for layer in range(2) for i in range(4)}  # fmt: skip
    archive = Archive(tmp_path, identity, Codec.RAW_ZSTD)
    archive.put([(key, kv[0], kv[1]) for key, kv in blocks.items()])
    archive.remove("s0")  # dead records: a third of the segment
    live = {key: kv for key, kv in blocks.items() if key.session != "s0"}
    disk = archive.disk_bytes()
    from h3d.store.files import FileOps

    class NoSpace(FileOps):  # ENOSPC at the rewritten manifest's rename, or at a segment's delete
        def replace(self, src: Path, dst: Path) -> None:
            if crash == "before the manifest":
                _raise_enospc()
            super().replace(src, dst)

        def unlink(self, path: Path, missing_ok: bool = False) -> None:
            if crash == "before the old segments go" and path.name.startswith("seg-"):
                _raise_enospc()
            super().unlink(path, missing_ok)

    archive.files = NoSpace()
    if crash is None:
        assert archive.compact(keep_ratio=1.0) > 0 and archive.disk_bytes() < disk
    else:
        with pytest.raises(ArchiveError):
            archive.compact(keep_ratio=1.0)
        archive.files = FileOps()
    archive.close()
    with Archive(tmp_path, identity, Codec.RAW_ZSTD) as reopened:
        assert reopened.keys() == frozenset(live)
        for key, kv in live.items():
            k, v = reopened.get(key)
            assert torch.equal(k, kv[0]) and torch.equal(v, kv[1])
        if crash is None:
            assert reopened.disk_bytes() == reopened.live_bytes()
        reopened.put([(BlockKey("s9", 0, 0), *live[BlockKey("s1", 0, 0)])])  # and it takes writes


def _raise_enospc(*args: object, **kwargs: object) -> None:
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("policy", ["exact", "attention_entropy"])
def test_reads_of_blocks_staged_from_the_archive_count_as_ssd_reads(
    policy: str, checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A block staged from the archive and read in the same step is an SSD read, not a DDR hit,
    whichever path counts it (the eager exact path, or HBF's promotion, which counts only what
    the selections read): `ddr_hits` never goes negative and the misses are DDR or SSD reads."""
    slot = 2 * 16 * 2 * 16 * 4  # llama_gqa4_tied: one layer's K+V of a 16-token block
    engine = make_engine(
        checkpoint("llama_gqa4_tied"), policy=policy, ssd_path=str(tmp_path / "ssd"), hbm_mb=3 * 6 * slot / 2**20,
        ddr_mb=60 * slot / 2**20, window_tokens=64, window_min_tokens=64, recent_tokens=32, dense_layers=1,
        prefill_chunk_tokens=128,
    )  # fmt: skip
    s = engine.create_session()
    engine.append(s, token_ids=random_prompt(600, VOCAB_SIZE, seed=4))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.complete(s, "", params)
    engine.close_session(s)  # its KV to the archive only: the next steps stage it back
    engine.complete(s, "", params)
    t = engine.tier_stats()
    assert t.ssd_read_count > 0 and t.hbm_misses > 0
    assert t.ddr_hits >= 0 and t.hbm_misses <= t.ddr_hits + t.ssd_read_count
    if policy == "exact":  # every staged block is read by the step that staged it
        assert t.hbm_misses == t.ddr_hits + t.ssd_read_count
    engine.close()


def test_sliding_window_layers_tiered_equal_untiered(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A model with sliding-window layers (Qwen2's last two of three, a 24-token window), its
    sessions' KV through HBM, DDR and the archive: every token's logits as with all of it in HBM.
    A decode token of a sliding layer reads only its window's blocks (fewer reads than its full
    layer's), so what the tiers hold of older blocks must not matter to those layers."""
    name = "qwen2_window_layers"
    ids = [list(p) + random_prompt(GEN, VOCAB_SIZE, seed=50 + i) for i, p in enumerate(PROMPTS)]
    lens = [len(p) for p in PROMPTS]
    big = make_engine(checkpoint(name), prefill_chunk_tokens=64, hbm_mb=64.0, ddr_mb=1.0)
    per_token = kv_bytes_per_token(big)
    tiered = make_engine(
        checkpoint(name),
        hbm_mb=per_token * TOTAL_TOKENS * 0.15 / 2**20,
        ddr_mb=per_token * TOTAL_TOKENS * 0.40 / 2**20,
        ssd_path=str(tmp_path / "ssd"),
        check_invariants=True,
    )
    want = teacher_forced(big, ids, lens, 64)
    got = teacher_forced(tiered, ids, lens, 64)
    stats = tiered.tier_stats()
    assert stats.ssd_read_count > 0 and stats.hbm_misses > 0
    # The same weights with the window taken out of the config read every block of every layer.
    full_dir = tmp_path / "full"
    shutil.copytree(checkpoint(name), full_dir)
    raw = json.loads((full_dir / "config.json").read_text())
    raw.update(use_sliding_window=False, sliding_window=None, layer_types=["full_attention"] * 3)
    (full_dir / "config.json").write_text(json.dumps(raw))
    full = make_engine(full_dir, prefill_chunk_tokens=64, hbm_mb=64.0, ddr_mb=1.0)
    unwindowed = teacher_forced(full, ids, lens, 64)
    reads = lambda e: e.tier_stats().hbm_hits + e.tier_stats().hbm_misses  # noqa: E731
    assert reads(big) < 0.6 * reads(full)  # two of three layers read 2-3 blocks a token, not up to 16
    assert max((u - w).abs().max().item() for u, w in zip(unwindowed, want, strict=True)) > 1e-2
    full.close()
    for g, w in zip(got, want, strict=True):
        scale = max(1.0, w.abs().max().item())
        assert (g - w).abs().max().item() <= 1e-5 * scale
    big.close()
    tiered.close()
