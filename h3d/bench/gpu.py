"""GPU benchmark (issue 7): h3d's tiered KV cache against transformers on a Llama-3-8B-shaped model.

    python -m h3d.bench.gpu [--contexts 32768 131072] [--steps 32] [--modes ...] [--out FILE.json]
                            [--write docs/BENCHMARKS.md] [--many-sessions N] [--max-seconds 540]
    python -m h3d.bench.gpu --tiny --steps 4          # the same path on the CPU, tiny shapes, fp32
    python -m h3d.bench.gpu --from-json A.json [B.json] --write docs/BENCHMARKS.md   # render saved runs

Random bf16 weights (std 0.02, norms 1), random prompt ids, batch 1, block_size 32. First the
ceilings: HBM copy bandwidth (bytes read + written) and pinned host->device bandwidth. Then, per
context T, each mode on a fresh runner (or cache): prefill T tokens (TTFT; one forward for both,
h3d's layer by layer in slices of tokens, `DecoderLayer.forward_rows`), 4 warm-up decode steps,
then `--steps` greedy steps timed one by one (synchronized): decode is their median.

- `floor`: (weight bytes + KV bytes of T) / HBM copy bandwidth, the least a full-KV step costs.
- `exact_full`: policy exact, every block in HBM; decode steps replayed as CUDA graphs
  (`h3d.engine.graphs`). `exact_full_eager`, `exact_25pct_eager`: the same without graphs (each
  kernel launched from Python), side by side in the same run.
- `exact_25pct`: policy exact, HBM holds 25 % of T's blocks, the rest is read in place from pinned
  DDR by the kernel over PCIe (`pcie_floor_ms`: those bytes over the measured H2D bandwidth).
- `attention_entropy_3GiB`: HBF policy attention_entropy (a 2,048-token window held fixed, 2 dense layers),
  3 GiB of HBM for KV, the digests included (the pool gets what they leave), the rest in DDR;
  `hbf_latency_us_p50` is the host-side planning per step.
- `hf_dynamic`, `hf_offloaded`: transformers' LlamaForCausalLM (sdpa) with a DynamicCache, and with
  the offloaded one (`DynamicCache(offloading=True)`, else `OffloadedCache`).
- `--many-sessions N`: N sessions of `--many-context` tokens decoding in one batch (attention_entropy,
  `--many-hbm-gb` of HBM for KV): aggregate tokens/s and step latency p50/p99.

JSON goes to `--out` after every mode (a run cut short keeps what it measured); an error in one
mode is recorded as `{"error": ...}` and the run goes on; past `--max-seconds` the remaining modes
are skipped. GB are 1e9 bytes. Imports torch and h3d's engine core only (transformers for the
baselines): it runs on a bare GPU host with torch alone (no SSD archive here).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from h3d.bench.report import write_section
from h3d.config import EngineConfig
from h3d.engine.runner import Chunk, ModelRunner
from h3d.hbf.digests import block_scores
from h3d.hbf.policy import HbfConfig
from h3d.kv.blocks import SeqId
from h3d.kv.pool import KVPool
from h3d.model.config import ModelConfig, parse_model_config
from h3d.model.llama import CausalLM
from h3d.model.rope import RotaryEmbedding
from h3d.tiers.stats import TierCounters

BLOCK = 32
WARMUP = 4
PROMOTE_MB = EngineConfig().promote_mb_per_step  # the daemon's default
H3D_MODES = ("exact_full", "exact_full_eager", "exact_25pct", "exact_25pct_eager", "attention_entropy_3GiB")
HF_MODES = ("hf_dynamic", "hf_offloaded")
MODES = ("floor", *H3D_MODES, *HF_MODES)
MARK = "gpu-bench"
S = TypeVar("S")


@dataclass(frozen=True, slots=True)
class Sizes:
    """What `--tiny` changes: shapes, dtype, device and budgets; the code path is the same."""

    model: dict[str, Any]  # a config.json dict (HF key names)
    dtype: torch.dtype
    contexts: tuple[int, ...]
    prefill_chunk: int
    min_prefill_chunk: int  # a prefill that runs out of memory is retried with half the chunk, down to this
    entropy_hbm_bytes: int  # attention_entropy_3GiB's HBM for KV
    hbf: dict[str, Any]  # EngineConfig HBF keys beyond the policy
    many_context: int
    many_hbm_gb: float
    copy_bytes: int  # HBM copy ceiling
    h2d_bytes: int  # pinned H2D ceiling

    @staticmethod
    def pick(tiny: bool) -> Sizes:
        shape = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32)
        shape.update(num_attention_heads=32, num_key_value_heads=8, head_dim=128)
        if tiny:
            shape = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
            shape.update(num_attention_heads=8, num_key_value_heads=2, head_dim=32)
        model = {"architectures": ["LlamaForCausalLM"], **shape, "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
        model["tie_word_embeddings"] = False
        if tiny:
            hbf = dict(window_tokens=256, window_min_tokens=128, window_max_tokens=512, recent_tokens=64)
            return Sizes(model, torch.float32, (512, 1024), 1024, 64, 3 << 18, hbf, 512, 0.001, 64 << 20, 0)
        # The issue's mode: a 2,048-token window, held there (random weights give the entropy no
        # meaning to resize on); 16-token digests, as in docs/BENCHMARKS.md's figures.
        hbf = dict(window_tokens=2048, window_min_tokens=2048, window_max_tokens=2048, digest_tokens=16)
        # prefill: the whole prompt in one chunk (layer by layer, in slices: `DecoderLayer.forward_rows`)
        return Sizes(model, torch.bfloat16, (32768, 131072), 131072, 1024, 3 << 30, hbf, 32768, 40.0, 4 << 30, 1 << 30)


@dataclass(slots=True)
class Bench:
    """One run's state: the model, where results go, the clock."""

    args: argparse.Namespace
    sizes: Sizes
    device: torch.device
    raw: dict[str, Any]  # the model's config.json dict (both implementations are built from it)
    model: CausalLM
    cfg: ModelConfig
    weight_bytes: int
    deadline: float
    data: dict[str, Any]
    # T -> exact_full's (logits, greedy token) per decode step
    exact_logits: dict[int, list[tuple[torch.Tensor, int]]] = field(default_factory=dict)
    exact_first: dict[int, int] = field(default_factory=dict)  # T -> exact_full's first token (from prefill)
    exact_prefill: dict[int, torch.Tensor] = field(default_factory=dict)  # T -> exact_full's prefill logits
    last_logits: torch.Tensor | None = None  # the last prefill's last-token logits
    chunks: dict[int, int] = field(default_factory=dict)  # T -> the prefill chunk that fit in memory
    hf: torch.nn.Module | None = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def record(self, mode: str, context: int, fields: dict[str, Any]) -> None:
        self.data["modes"].setdefault(mode, {})[str(context)] = fields
        _save(self.args.out, self.data)


def log(msg: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- the model -------------------------------------------------------------------------------


@torch.no_grad()
def randomize(module: torch.nn.Module, seed: int) -> None:
    """Every weight ~ N(0, 0.02), norms 1, biases 0 (never zeros: they time faster than data)."""
    for i, (name, p) in enumerate(module.named_parameters()):
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.normal_(0.0, 0.02, generator=torch.Generator(p.device).manual_seed(seed + i))


def build_h3d(raw: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int) -> CausalLM:
    """h3d's model with random weights, built as `h3d.model.loader` builds it (meta, then assigned)."""
    cfg = parse_model_config(raw)
    with torch.device("meta"):
        model = CausalLM(cfg, torch.device("meta"))
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)
    state = {name: torch.empty(p.shape, dtype=dtype, device=device) for name, p in model.named_parameters()}
    model.load_state_dict(state, strict=True, assign=True)
    randomize(model, seed)
    return model.eval().requires_grad_(False)


def build_hf(raw: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = {k: v for k, v in raw.items() if k not in ("architectures", "rope_theta")}
    config = LlamaConfig(**keys, rope_parameters={"rope_type": "default", "rope_theta": raw["rope_theta"]})
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype` on the device, never a float32 copy first
    try:
        with torch.device(device):
            model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(default)
    for p in model.parameters():  # not model.to(dtype): RoPE's inv_freq buffer stays float32, as HF keeps it
        p.data = p.data.to(dtype)
    randomize(model, seed + 1000)
    return model.eval().requires_grad_(False)


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ---- ceilings --------------------------------------------------------------------------------


def _median_s(fn: Callable[[], object], reps: int, cuda: bool, warm: int = 3) -> float:
    """Median seconds of fn(): CUDA events around each call on the GPU, perf_counter on the CPU."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_s(src: torch.Tensor, device: torch.device, reps: int) -> float:
    """Median seconds of one copy of `src` into a buffer on `device` (non-blocking from pinned memory)."""
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    return _median_s(lambda: dst.copy_(src, non_blocking=True), reps, device.type == "cuda")


def ceilings(sizes: Sizes, device: torch.device) -> dict[str, float | None]:
    """HBM copy GB/s (read + write) and pinned H2D GB/s; on the CPU, a DRAM copy and no H2D."""
    cuda = device.type == "cuda"
    src = torch.empty(sizes.copy_bytes // 4, dtype=torch.float32, device=device).normal_()
    hbm = 2 * sizes.copy_bytes / _copy_s(src, device, 20) / 1e9
    h2d = None
    if cuda:
        host = torch.empty(sizes.h2d_bytes // 4, dtype=torch.float32, pin_memory=True).normal_()
        h2d = sizes.h2d_bytes / _copy_s(host, device, 10) / 1e9
    del src
    _free()
    return {"hbm_copy_gbps": round(hbm, 1), "h2d_gbps": None if h2d is None else round(h2d, 2)}


# ---- measuring -------------------------------------------------------------------------------


class Peak:
    """GPU memory allocated beyond what was resident when built (the weights), at its peak."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            _free()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()

    def gb(self) -> float | None:
        return round((torch.cuda.max_memory_allocated() - self.base) / 1e9, 3) if self.cuda else None

    def restart(self) -> float | None:
        """The peak so far; the next `gb` counts from now (against the same base)."""
        out = self.gb()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return out


def run_steps(b: Bench, step: Callable[[S], S], tok: S, n: int, stop: bool) -> tuple[list[float], list[S], S]:
    """n decode steps, each timed alone (synchronized); with `stop`, none after the deadline once one ran."""
    times: list[float] = []
    toks: list[S] = []
    for _ in range(n):
        if stop and times and time.monotonic() > b.deadline:
            log(f"time budget spent: {len(times)} of {n} timed steps")
            break
        b.sync()
        t0 = time.perf_counter()
        tok = step(tok)
        b.sync()
        times.append(time.perf_counter() - t0)
        toks.append(tok)
    return times, toks, tok


def decode_fields(times: list[float]) -> dict[str, Any]:
    ms = np.array(times) * 1e3
    p50, p90 = float(np.percentile(ms, 50)), float(np.percentile(ms, 90))
    return {"decode_ms_per_tok": round(p50, 3), "decode_ms_p90": round(p90, 3), "steps": len(times)}


def tier_fields(runner: ModelRunner, c0: TierCounters, lat0: int, steps: int) -> dict[str, Any]:
    """HBM hit rate, fetched GB per step and median HBF planning since (c0, lat0), over `steps` steps."""
    c1, lats = runner.tiers.counters, runner.tiers.latencies_us[lat0:]
    hits, misses = c1.hbm_hits - c0.hbm_hits, c1.hbm_misses - c0.hbm_misses
    return {
        "hbm_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "fetch_gb_per_step": round((c1.fetch_bytes - c0.fetch_bytes) / steps / 1e9, 4),
        "promote_gb_per_step": round((c1.promote_count - c0.promote_count) * runner.hbm.slot_bytes / steps / 1e9, 4),
        "hbf_latency_us_p50": round(float(np.median(lats)), 1) if lats else None,  # exact: no planning
    }


class PrefillOOM(Exception):
    pass


def plan(
    b: Bench, mode: str, tokens: int, steps: int, sessions: int = 1, hbm_bytes: int = 0
) -> tuple[list[int], int, HbfConfig]:
    """(HBM slots of each layer's region, DDR slots, HBF config) of a mode for `sessions` of
    `tokens` tokens that then decode `steps` (+ warm-up) tokens."""
    cfg, nl = b.cfg, b.cfg.num_layers
    nb_ctx = -(-tokens // BLOCK)
    nb = sessions * -(-(tokens + WARMUP + steps + 1) // BLOCK)  # every block the run writes
    mode = mode.removesuffix("_eager")
    if mode == "exact_full":
        return [nb + 2] * nl, 4 * nl, replace(EngineConfig(), policy="exact").hbf
    if mode == "exact_25pct":
        hbm = max(1, math.ceil(nb_ctx / 4))
        return [hbm] * nl, (nb - hbm) * nl + 4 * nl, replace(EngineConfig(), policy="exact").hbf
    # The budget holds the digests too (they stay in HBM): the pool gets what they leave.
    hbf = replace(EngineConfig(), policy="attention_entropy", **b.sizes.hbf).hbf
    parts = max(1, BLOCK // hbf.digest_tokens)
    elem = torch.empty((), dtype=b.sizes.dtype).element_size()
    digest_bytes = nb * parts * nl * cfg.num_kv_heads * 2 * cfg.head_dim * elem
    budget = (hbm_bytes or b.sizes.entropy_hbm_bytes) - digest_bytes
    slots = KVPool.slots_for_budget(budget / 2**20, BLOCK, cfg.num_kv_heads, cfg.head_dim, b.sizes.dtype)
    # The dense layers read every block at every step: their regions hold all of them (at most
    # half of the pool, `dense_hbm_share`), the other layers share the rest.
    dense = min(hbf.dense_layers, nl - 1)
    dense_slots = min(nb + 2, slots // (2 * dense)) if dense else 0
    sparse = max(1, min((slots - dense_slots * dense) // (nl - dense), nb + 2))
    regions = [dense_slots] * dense + [sparse] * (nl - dense)
    # DDR: every block HBM does not hold, plus room for copies of half of HBM's (HBF's victims keep
    # one); a 32nd with many sessions, whose DDR (pinned) must fit in the host's memory (a victim
    # with no room for its copy stays in HBM).
    share = 2 if sessions == 1 else 32
    held = sum(min(r, nb) for r in regions)
    ddr = nb * nl - held + math.ceil(held / share) + 4 * nl * sessions
    return regions, ddr, hbf


def prefill(b: Bench, runner: ModelRunner, seq: SeqId, ids: list[int], chunk: int) -> tuple[float, int]:
    """All of `ids` into `seq`'s cache, chunk by chunk; returns (seconds, greedy next token). The
    last token's logits stay in `b.last_logits`."""
    b.sync()
    t0 = time.perf_counter()
    logits = torch.empty(0)
    starts = range(0, len(ids), chunk)
    for i, a in enumerate(starts):
        e = min(a + chunk, len(ids))
        try:
            logits = runner.execute([Chunk(seq, tuple(ids[a:e]), a, want_logits=e == len(ids), final=e == len(ids))])
        except torch.OutOfMemoryError as exc:
            raise PrefillOOM(f"at {a} tokens, chunk {chunk}: {exc}") from None
        if len(starts) >= 8 and (i + 1) % (len(starts) // 4) == 0:
            log(f"  prefill {e} of {len(ids)} tokens, {time.perf_counter() - t0:.1f} s")
    tok = int(logits[0].argmax())
    b.sync()
    b.last_logits = logits[0]
    return time.perf_counter() - t0, tok


def run_h3d(b: Bench, mode: str, ids: list[int]) -> dict[str, Any]:
    """One h3d mode; a prefill that runs out of memory is run again with half the chunk (and the modes
    after it start there)."""
    first = b.args.prefill_chunk or b.sizes.prefill_chunk
    chunk = b.chunks.get(len(ids), first)  # an earlier mode's retries are not paid again
    while True:
        try:
            out = _h3d_once(b, mode, ids, chunk, b.args.steps)
            b.chunks[len(ids)] = chunk
            return out if chunk == first else {**out, "prefill_chunk_halved_from": first}
        except PrefillOOM as exc:
            if chunk // 2 < b.sizes.min_prefill_chunk:
                raise
            log(f"{mode}: prefill ran out of memory ({str(exc)[:120]}); again with chunks of {chunk // 2}")
        _free()
        chunk //= 2


def _h3d_once(b: Bench, mode: str, ids: list[int], chunk: int, steps: int) -> dict[str, Any]:
    t = len(ids)
    hbm, ddr, hbf = plan(b, mode, t, steps)
    peak = Peak(b.device)
    runner = ModelRunner(
        b.model, hbm, ddr, BLOCK, archive=None, high_watermark=0.85, hbf=hbf, promote_mb_per_step=PROMOTE_MB
    )
    runner.graphs.enabled = runner.graphs.enabled and not mode.endswith("_eager")
    seq = SeqId(1)
    runner.open(seq)
    if hbf.policy != "exact":
        runner.digests.reserve(seq, -(-(t + WARMUP + steps + 1) // BLOCK))  # the budget counted them all
    prefill_s, tok = prefill(b, runner, seq, ids, chunk)
    prefill_peak = peak.restart()
    pos = t

    # Every mode after exact_full is fed exact_full's tokens (teacher forcing) and its logits are
    # compared with exact_full's at each step: the fast paths' check on the card.
    ref = b.exact_logits.get(t) if mode != "exact_full" else None
    if mode == "exact_full":
        b.exact_first[t] = tok
        assert b.last_logits is not None
        b.exact_prefill[t] = b.last_logits
    elif ref is not None:
        tok = b.exact_first[t]  # the same first input, whatever this mode's prefill picked
    mine: list[torch.Tensor] = []
    agree: list[bool] = []

    def step(tok: int) -> int:
        nonlocal pos
        logits = runner.execute([Chunk(seq, (tok,), pos, True)])[0]
        i = pos - t
        pos += 1
        nxt = int(logits.argmax())
        if ref is None:
            mine.append(logits)
            return nxt
        if i < len(ref):
            diff = (logits - ref[i][0]).abs().max()
            mine.append(diff)
            agree.append(nxt == ref[i][1])
            return ref[i][1]
        return nxt

    _, warm, tok = run_steps(b, step, tok, WARMUP, stop=False)
    before = replace(runner.tiers.counters), len(runner.tiers.latencies_us)
    replays = runner.graphs.replays
    times, timed, tok = run_steps(b, step, tok, steps, stop=True)
    slot = runner.hbm.slot_bytes
    out: dict[str, Any] = {"prefill_s": round(prefill_s, 3), **decode_fields(times)}
    out["graph_steps"] = runner.graphs.replays - replays
    if mode in (b.args.profile or []) and steps == b.args.steps:
        profile(b, mode, t, step, tok)
    decode_peak = peak.gb()
    both = [x for x in (prefill_peak, decode_peak) if x is not None]
    out.update(peak_gpu_gb_beyond_weights=max(both) if both else None, peak_decode_gb_beyond_weights=decode_peak)
    out.update(tier_fields(runner, *before, len(times)))
    out.update(hbm_budget_gb=round(sum(hbm) * slot / 1e9, 3), ddr_gb=round(ddr * slot / 1e9, 3))
    out["hbm_regions"] = sorted(set(hbm))
    out["prefill_chunk"] = chunk
    generated = warm + timed
    if mode == "exact_full" and steps == b.args.steps:
        b.exact_logits[t] = list(zip(mine, generated, strict=False))
    elif ref is not None and agree:
        scale = max(float(x.abs().max()) for x, _ in ref[: len(mine)])
        out["argmax_agree_exact_full"] = round(sum(agree) / len(agree), 3)
        out["logits_max_diff_exact_full"] = round(max(float(d) for d in mine), 4)
        out["logits_max_abs_exact_full"] = round(scale, 3)
    ceil = b.data["ceilings"]
    if hbf.policy != "exact" and ceil.get("h2d_gbps") and ceil.get("hbm_copy_gbps"):
        # The least its step can cost for what it read: the weights, the dense layers' KV and the
        # digests from HBM, the bytes it fetched over PCIe (the selections' HBM reads left out).
        elem = b.model.lm_head.weight_t.element_size()
        dense_kv = t * b.cfg.kv_bytes_per_token // b.cfg.num_layers * hbf.dense_layers * elem
        hbm_s = (b.weight_bytes + dense_kv + runner.digests.nbytes()) / (ceil["hbm_copy_gbps"] * 1e9)
        out["reads_floor_ms"] = round((hbm_s + out["fetch_gb_per_step"] / ceil["h2d_gbps"]) * 1e3, 2)
    if mode == "exact_25pct" and b.data["ceilings"]["h2d_gbps"]:
        below = t * b.cfg.kv_bytes_per_token * b.model.lm_head.weight_t.element_size() - sum(hbm) * slot
        out["pcie_floor_ms"] = round(max(below, 0) / (b.data["ceilings"]["h2d_gbps"] * 1e9) * 1e3, 2)
    return out


def prefill_check(b: Bench, ids: list[int], chunk: int) -> dict[str, Any]:
    """The same prompt prefilled again in chunks of `chunk` (each chunk's attention reading the
    earlier blocks from the pool), against exact_full's one-chunk prefill: the last token's logits
    compared, and both times (side by side in one run)."""
    hbm, ddr, hbf = plan(b, "exact_full", len(ids), 0)
    runner = ModelRunner(b.model, hbm, ddr, BLOCK, archive=None, high_watermark=0.85, hbf=hbf)
    runner.open(SeqId(1))
    seconds, _ = prefill(b, runner, SeqId(1), ids, chunk)
    assert b.last_logits is not None
    one = b.exact_prefill[len(ids)]
    return {
        "chunk": chunk,
        "prefill_s_chunked": round(seconds, 3),
        "logits_max_diff": round(float((b.last_logits - one).abs().max()), 4),
        "logits_max_abs": round(float(one.abs().max()), 3),
        "same_argmax": bool(b.last_logits.argmax() == one.argmax()),
    }


def profile(b: Bench, mode: str, t: int, step: Callable[[int], int], tok: int) -> None:
    """8 more decode steps under torch.profiler: the ops by device time and by host time, to a
    text file beside the JSON (`--profile MODE`)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.device.type == "cuda" else [])
    b.sync()
    t0 = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        for _ in range(8):
            tok = step(tok)
        b.sync()
    wall = (time.perf_counter() - t0) / 8 * 1e3
    avg = prof.key_averages()
    dev_key = "self_device_time_total" if b.device.type == "cuda" else "self_cpu_time_total"
    text = [f"{mode} at {t} tokens: 8 decode steps, {wall:.2f} ms/step under the profiler", ""]
    text += ["By device time:", avg.table(sort_by=dev_key, row_limit=25), ""]
    text += ["By host time:", avg.table(sort_by="self_cpu_time_total", row_limit=25)]
    out = (b.args.out or Path("bench/results/profile.json")).with_suffix(f".{mode}.{t}.prof.txt")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(text))
    log(f"profile of {mode} at {t}: {out}")


def warm_up(b: Bench) -> None:
    """Pay for first calls (cuBLAS handles, Triton compiles, pinned allocations, SDPA selection) before
    the first mode: a short prompt through the DDR-reading and the HBF paths, a few decode steps."""
    n = 2 * b.sizes.hbf["window_tokens"] + BLOCK  # enough blocks that HBF selects
    ids = torch.randint(0, b.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    t0 = time.monotonic()
    for mode, chunk in (("exact_full", n), ("exact_25pct", n // 2), ("attention_entropy_3GiB", n // 2)):
        try:  # a prompt in one chunk (sliced when long) and in two (the second reads the first's blocks)
            _h3d_once(b, mode, ids, chunk, 2)
        except Exception as exc:  # the modes will meet it again, and record it
            log(f"warm-up {mode} failed: {type(exc).__name__}: {exc}")
    _free()
    log(f"warm-up done in {time.monotonic() - t0:.1f} s")


# ---- transformers ------------------------------------------------------------------------------


def hf_cache(kind: str, device: torch.device) -> Any:
    """A fresh cache for the mode; a str says why the mode is skipped."""
    import transformers

    if kind == "hf_dynamic":
        return transformers.DynamicCache()
    if device.type != "cuda":
        return "an offloaded cache needs a CUDA device"
    if "offloading" in inspect.signature(transformers.DynamicCache.__init__).parameters:
        return transformers.DynamicCache(offloading=True)
    if hasattr(transformers, "OffloadedCache"):
        return transformers.OffloadedCache()
    return f"transformers {transformers.__version__} has no offloaded cache"


@torch.inference_mode()
def hf_generate(b: Bench, cache: Any, ids: list[int], steps: int) -> tuple[float, list[float]]:
    """Prefill `ids` in one forward into `cache`, then greedy decode: (prefill seconds, timed step seconds)."""
    assert b.hf is not None
    model = b.hf
    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"  # renamed in later 5.x
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    x = torch.tensor([ids], device=b.device)
    b.sync()
    t0 = time.perf_counter()
    nxt = model(input_ids=x, use_cache=True, **{kw: cache}, **keep).logits[:, -1:].argmax(-1)
    b.sync()
    prefill_s = time.perf_counter() - t0

    def step(tok: torch.Tensor) -> torch.Tensor:
        return model(input_ids=tok, use_cache=True, **{kw: cache}).logits[:, -1:].argmax(-1)

    _, _, nxt = run_steps(b, step, nxt, WARMUP, stop=False)
    times, _, _ = run_steps(b, step, nxt, steps, stop=True)
    return prefill_s, times


def run_hf(b: Bench, mode: str, ids: list[int]) -> dict[str, Any]:
    if b.hf is None:
        log("building transformers' LlamaForCausalLM")
        b.hf = build_hf(b.raw, b.sizes.dtype, b.device, b.args.seed)
        hf_generate(b, hf_cache("hf_dynamic", b.device), ids[:1024], 2)  # warm-up: its first calls
    peak = Peak(b.device)
    cache = hf_cache(mode, b.device)
    if isinstance(cache, str):
        return {"skipped": cache}
    prefill_s, times = hf_generate(b, cache, ids, b.args.steps)
    res: dict[str, Any] = {"prefill_s": round(prefill_s, 3), **decode_fields(times)}
    return {**res, "peak_gpu_gb_beyond_weights": peak.gb(), "hbm_hit_rate": None, "fetch_gb_per_step": None}


# ---- many sessions -------------------------------------------------------------------------------


def run_many(b: Bench, n: int, context: int, hbm_gb: float) -> dict[str, Any]:
    """n sessions of `context` tokens, prefilled one by one, then decoding together: one execute per step."""
    hbm, ddr, hbf = plan(b, "attention_entropy", context, b.args.steps, n, int(hbm_gb * 1e9))
    peak = Peak(b.device)
    slot = 2 * BLOCK * b.cfg.num_kv_heads * b.cfg.head_dim * b.model.lm_head.weight_t.element_size()
    log(f"many sessions: {sum(hbm) * slot / 1e9:.1f} GB of HBM pool, {ddr * slot / 1e9:.1f} GB of pinned DDR")
    t0 = time.perf_counter()
    runner = ModelRunner(
        b.model, hbm, ddr, BLOCK, archive=None, high_watermark=0.85, hbf=hbf, promote_mb_per_step=PROMOTE_MB
    )
    log(f"many sessions: pools allocated (DDR pinned) in {time.perf_counter() - t0:.1f} s")
    seqs = [SeqId(i + 1) for i in range(n)]
    toks, prefill_s = [], 0.0
    gen = torch.Generator().manual_seed(b.args.seed + 7)
    for seq in seqs:
        runner.open(seq)
        runner.digests.reserve(seq, -(-(context + WARMUP + b.args.steps + 1) // BLOCK))
        ids = torch.randint(0, b.cfg.vocab_size, (context,), generator=gen).tolist()
        s, tok = prefill(b, runner, seq, ids, b.args.prefill_chunk or b.sizes.prefill_chunk)
        prefill_s += s
        toks.append(tok)
        log(f"many sessions: prefilled {seq} of {n} in {s:.2f} s")
    pos = context

    def step(cur: list[int]) -> list[int]:
        nonlocal pos
        logits = runner.execute([Chunk(s, (t,), pos, True) for s, t in zip(seqs, cur, strict=True)])
        pos += 1
        return [int(x) for x in logits.argmax(-1).tolist()]

    _, _, toks = run_steps(b, step, toks, WARMUP, stop=False)
    before = replace(runner.tiers.counters), len(runner.tiers.latencies_us)
    replays = runner.graphs.replays
    times, _, _ = run_steps(b, step, toks, b.args.steps, stop=True)
    ms = np.array(times) * 1e3
    out: dict[str, Any] = {"sessions": n, "context": context}
    out["hbm_budget_gb"] = round(sum(hbm) * runner.hbm.slot_bytes / 1e9, 3)
    out.update(prefill_s_total=round(prefill_s, 3), step_ms_p50=round(float(np.percentile(ms, 50)), 3))
    out["step_ms_p99"] = round(float(np.percentile(ms, 99)), 3)
    out["tokens_per_s"] = round(n * 1e3 / float(np.median(ms)), 1)
    out.update(peak_gpu_gb_beyond_weights=peak.gb(), steps=len(times), **tier_fields(runner, *before, len(times)))
    out["graph_steps"] = runner.graphs.replays - replays
    out["ddr_gb"] = round(ddr * runner.hbm.slot_bytes / 1e9, 3)
    return out


# ---- one run ------------------------------------------------------------------------------------


def floor_fields(b: Bench, t: int) -> dict[str, Any]:
    kv = t * b.cfg.kv_bytes_per_token * b.model.lm_head.weight_t.element_size()
    ms = (b.weight_bytes + kv) / (b.data["ceilings"]["hbm_copy_gbps"] * 1e9) * 1e3
    out: dict[str, Any] = {"prefill_s": None, "decode_ms_per_tok": round(ms, 3), "peak_gpu_gb_beyond_weights": None}
    out.update(hbm_hit_rate=None, fetch_gb_per_step=None, weight_gb=round(b.weight_bytes / 1e9, 3))
    out["kv_gb"] = round(kv / 1e9, 3)
    return out


def _unavailable(b: Bench, mode: str) -> str | None:
    if time.monotonic() > b.deadline:
        return f"time budget spent (--max-seconds {b.args.max_seconds})"
    if mode in HF_MODES and b.args.no_hf:
        return "--no-hf"
    if mode in HF_MODES and importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    return None


def _summary(f: dict[str, Any]) -> str:
    keys = ("prefill_s", "decode_ms_per_tok", "peak_gpu_gb_beyond_weights", "hbm_hit_rate", "error", "skipped")
    return ", ".join(f"{k}={f[k]}" for k in keys if f.get(k) is not None)


def run_mode(b: Bench, mode: str, ids: list[int]) -> dict[str, Any]:
    why = _unavailable(b, mode)
    if why is not None:
        return {"skipped": why}
    try:
        return run_h3d(b, mode, ids) if mode in H3D_MODES else run_hf(b, mode, ids)
    except Exception as exc:  # one mode's failure (OOM, a missing API) must not end the run
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}


def run_context(b: Bench, t: int, modes: list[str]) -> None:
    ids = torch.randint(0, b.cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(b.args.seed + t)).tolist()
    b.record("floor", t, floor_fields(b, t))
    for mode in modes:
        if mode == "floor":
            continue
        log(f"T={t} {mode}: start")
        t0 = time.monotonic()
        fields = run_mode(b, mode, ids)
        _free()
        if mode == "exact_full" and t == min(b.args.contexts) and t in b.exact_prefill:
            fields["prefill_vs_chunked"] = prefill_check(b, ids, max(b.sizes.min_prefill_chunk, t // 4))
            _free()
        b.record(mode, t, fields)
        log(f"T={t} {mode}: {_summary(fields)} ({time.monotonic() - t0:.1f} s)")
    b.hf = None  # never two models' caches at once across contexts: rebuilt for the next one
    _free()


# ---- the report ---------------------------------------------------------------------------------


def _num(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.3g}"


def _ratio(x: float | None, ref: float | None) -> str:
    return f"{x / ref:.2f}x" if x is not None and ref else "—"


def _notes(f: dict[str, Any]) -> str:
    notes = []
    for key, text in (("error", "error: {}"), ("skipped", "skipped: {}")):
        if key in f:
            notes.append(text.format(str(f[key])[:90].replace("|", "/").replace("\n", " ")))
    if "kv_gb" in f:
        notes.append(f"weights {f['weight_gb']:.2f} GB + KV {f['kv_gb']:.2f} GB")
    if f.get("pcie_floor_ms") is not None:
        notes.append(f"PCIe floor {_num(f['pcie_floor_ms'])} ms")
    if f.get("reads_floor_ms") is not None:
        notes.append(f"floor of its reads {_num(f['reads_floor_ms'])} ms")
    if f.get("peak_decode_gb_beyond_weights") is not None and f.get("hbm_regions"):
        notes.append(f"decode peak {_num(f['peak_decode_gb_beyond_weights'])} GB")
    if f.get("promote_gb_per_step"):
        notes.append(f"promoted {_num(f['promote_gb_per_step'])} GB/step")
    if f.get("graph_steps") is not None and f.get("steps") and f.get("hbm_regions"):
        notes.append(f"graph steps {f['graph_steps']}/{f['steps']}")
    if f.get("hbf_latency_us_p50") is not None:
        notes.append(f"HBF planning p50 {_num(f['hbf_latency_us_p50'])} µs")
    if "argmax_agree_exact_full" in f:
        notes.append(
            f"fed exact_full's tokens: same argmax {f['argmax_agree_exact_full']:.0%}, logits within "
            f"{f['logits_max_diff_exact_full']} (of {f['logits_max_abs_exact_full']})"
        )
    elif "tokens_agree_exact_full" in f:  # runs saved before teacher forcing
        notes.append(f"tokens = exact_full's: {f['tokens_agree_exact_full']:.0%}")
    if "prefill_chunk_halved_from" in f:
        notes.append(f"prefill OOM at chunk {f['prefill_chunk_halved_from']}, ran at {f['prefill_chunk']}")
    if "prefill_vs_chunked" in f:
        c = f["prefill_vs_chunked"]
        notes.append(
            f"prefill in {c['chunk']}-token chunks: {_num(c['prefill_s_chunked'])} s, last logits within "
            f"{c['logits_max_diff']} (of {c['logits_max_abs']}), same argmax: {'yes' if c['same_argmax'] else 'no'}"
        )
    return "; ".join(notes)


def table(data: dict[str, Any]) -> str:
    modes = data["modes"]
    lines = [
        "| mode | context | prefill s | decode ms/tok | × floor | × hf_dynamic | peak GB beyond weights "
        "| HBM hit rate | fetch GB/step | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for t in sorted({int(c) for per in modes.values() for c in per}):
        floor = modes.get("floor", {}).get(str(t), {}).get("decode_ms_per_tok")
        hf = modes.get("hf_dynamic", {}).get(str(t), {}).get("decode_ms_per_tok")
        for mode in MODES:
            f = modes.get(mode, {}).get(str(t))
            if f is None:
                continue
            ms = f.get("decode_ms_per_tok")
            hit = f.get("hbm_hit_rate")
            lines.append(
                f"| {mode} | {t} | {_num(f.get('prefill_s'))} | {_num(ms)} "
                f"| {_ratio(ms, floor) if mode != 'floor' else '1.00x'} | {_ratio(ms, hf)} "
                f"| {_num(f.get('peak_gpu_gb_beyond_weights'))} | {'—' if hit is None else f'{hit:.3f}'} "
                f"| {_num(f.get('fetch_gb_per_step'))} | {_notes(f)} |"
            )
    many = data.get("many_sessions")
    if many:
        lines += ["", "| sessions × context | tokens/s | step ms p50 | step ms p99 | HBM hit rate | notes |"]
        lines.append("|---|---:|---:|---:|---:|---|")
        if "error" in many or "skipped" in many:
            lines.append(f"| — | — | — | — | — | {_notes(many)} |")
        else:
            lines.append(
                f"| {many['sessions']} × {many['context']} | {_num(many['tokens_per_s'])} "
                f"| {_num(many['step_ms_p50'])} | {_num(many['step_ms_p99'])} | {_num(many['hbm_hit_rate'])} "
                f"| HBM for KV {many['hbm_budget_gb']} GB; fetch {_num(many['fetch_gb_per_step'])} GB/step; "
                f"HBF planning p50 {_num(many['hbf_latency_us_p50'])} µs"
                + (f"; pinned DDR {many['ddr_gb']} GB" if "ddr_gb" in many else "")
                + (f"; graph steps {many['graph_steps']}/{many['steps']}" if "graph_steps" in many else "")
                + " |"
            )
    return "\n".join(lines)


def command(data: dict[str, Any]) -> str:
    """The command that made a saved run, from what it holds."""
    contexts = sorted({int(c) for per in data["modes"].values() for c in per})
    steps = max((f.get("steps", 0) for per in data["modes"].values() for f in per.values()), default=0)
    cmd = "python -m h3d.bench.gpu" + (" --tiny" if data["card"] == "cpu" else "")
    cmd += f" --contexts {' '.join(map(str, contexts))}" + (f" --steps {steps}" if steps and steps != 32 else "")
    many = data.get("many_sessions") or {}
    if "sessions" in many:
        cmd += f" --many-sessions {many['sessions']} --many-context {many['context']}"
    return f"`{cmd}`"


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Saved runs (say 32K and 128K, one device call each) as one: later runs' cells win."""
    data = json.loads(json.dumps(runs[0]))
    for run in runs[1:]:
        for mode, per in run["modes"].items():
            data["modes"].setdefault(mode, {}).update(per)
        data["many_sessions"] = run.get("many_sessions") or data.get("many_sessions")
        for key in ("date", "card"):
            if run[key] not in str(data[key]).split(", "):
                data[key] = f"{data[key]}, {run[key]}"
    return data


def section(data: dict[str, Any], commands: list[str]) -> str:
    c = data["ceilings"]
    shape = (
        "the --tiny shape (4 layers, hidden 256), fp32 on the CPU"
        if data["card"] == "cpu"
        else "Llama-3-8B shape (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256), "
        "random bf16 weights"
    )
    meta = (
        f"Measured {data['date']} on {data['card']}, torch {data['torch']}, Triton {data['triton']}, "
        f"transformers {data['transformers']}; {shape}; batch 1, block_size 32, random prompt ids. Decode is the "
        f"median of the timed greedy steps (after {WARMUP} warm-up steps), each synchronized. Ceilings: HBM copy "
        f"{c['hbm_copy_gbps']} GB/s (read + write), pinned H2D {c['h2d_gbps']} GB/s. `floor` = (weights + KV bytes) / "
        "HBM copy bandwidth; × floor and × hf_dynamic are ratios of decode time (lower is better); peak GB beyond "
        "weights is torch's peak allocation minus what was resident before the mode. GB = 1e9 bytes."
    )
    return f"{meta}\n\nCommand: {', '.join(commands)}\n\n{table(data)}"


# ---- main ---------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny shapes, fp32, on the CPU (debugging the path)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cpu with --tiny, else cuda")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="default 32768 131072 (--tiny: 512 1024)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per mode")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--prefill-chunk", type=int, default=None, help="h3d prefill chunk (default 8192, --tiny 256)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--many-sessions", type=int, default=0, help="N sessions decoding in one batch (0: off)")
    p.add_argument("--many-context", type=int, default=None, help="tokens per session (default 32768)")
    p.add_argument("--many-hbm-gb", type=float, default=None, help="HBM for their KV (default 40)")
    p.add_argument("--max-seconds", type=float, default=540.0, help="skip the modes left after this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", nargs="+", choices=H3D_MODES, default=None, help="profile 8 steps of these modes")
    p.add_argument("--out", type=Path, default=None, help="JSON (default bench/results/DATE-h200.json)")
    p.add_argument("--write", type=Path, default=None, help="update this markdown file's gpu-bench section")
    p.add_argument("--from-json", type=Path, nargs="+", default=None, help="render saved runs, measure nothing")
    return p.parse_args()


def selection_cost(b: Bench, context: int, repeats: int = 200) -> dict[str, Any]:
    """attention_entropy's device-side selection for one decode step of one sequence: per sparse
    layer, the digest bound of every block for each KV head (`block_scores`, over the digests'
    parts) and the per-head top-k of a 2,048-token window. Timed per layer as launched from Python
    (CUDA events; the median over `repeats`), and on a GPU also for a whole step's sparse layers
    replayed as one CUDA graph: the device's own time, without launch gaps."""
    cfg = b.cfg
    nb = context // BLOCK
    parts = max(1, BLOCK // int(b.sizes.hbf.get("digest_tokens", EngineConfig().digest_tokens)))
    g = torch.Generator(device=b.device).manual_seed(0)
    digests = torch.randn(cfg.num_kv_heads, nb, parts, 2, cfg.head_dim, generator=g, device=b.device)
    digests = digests.sort(dim=3).values.to(b.sizes.dtype)  # [Hkv, nb, parts, (min, max), D]
    q = torch.randn(cfg.num_heads, cfg.head_dim, generator=g, device=b.device).to(b.sizes.dtype)
    k = min(2048 // BLOCK, nb)
    sparse = cfg.num_layers - EngineConfig().dense_layers

    def once() -> None:
        torch.topk(block_scores(q, digests, per_head=True), k, dim=-1)

    per_layer = _median_s(once, repeats, b.device.type == "cuda", warm=10) * 1e6
    out: dict[str, Any] = {
        "selection_us_per_layer": round(per_layer, 1),
        "selection_ms_per_step": round(per_layer * sparse / 1e3, 3),
        "digest_parts": parts,
    }
    if b.device.type == "cuda":
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    once()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(sparse):
                    once()
            step = _median_s(graph.replay, 50, True) * 1e3
            out["selection_ms_per_step_graph"] = round(step, 3)
        except RuntimeError as exc:  # capture refused: the eager figures stand alone
            out["selection_graph_error"] = str(exc)[:200]
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    start = time.monotonic()
    sizes = Sizes.pick(args.tiny)
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device here: --tiny runs the same path on the CPU")
    if device.type == "cpu":
        torch.set_num_threads(1)  # CPU numbers only check the path; one thread does not thrash a shared host
    contexts = args.contexts = args.contexts or list(sizes.contexts)
    many_context = args.many_context or sizes.many_context
    longest = max([*contexts, many_context if args.many_sessions else 0])
    raw = {**sizes.model, "max_position_embeddings": longest + WARMUP + args.steps + 1024}
    date = dt.date.today().isoformat()
    args.out = args.out or Path("bench/results") / f"{date}-{'tiny' if args.tiny else 'h200'}.json"
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    data: dict[str, Any] = {"date": date, "card": card, "torch": torch.__version__, "triton": _version("triton")}
    data.update(transformers=_version("transformers"), ceilings={}, modes={}, many_sessions=None)
    log(f"{card}: building h3d's model {'(tiny)' if args.tiny else '(Llama-3-8B shape)'}, contexts {contexts}")
    model = build_h3d(raw, sizes.dtype, device, args.seed)
    b = Bench(args, sizes, device, raw, model, model.config, param_bytes(model), start + args.max_seconds, data)
    data["ceilings"] = ceilings(sizes, device)
    _save(args.out, data)
    log(f"weights {b.weight_bytes / 1e9:.2f} GB; ceilings {data['ceilings']}")
    warm_up(b)
    for t in contexts:
        run_context(b, t, args.modes)
        entry = data["modes"].get("attention_entropy_3GiB", {}).get(str(t))
        if entry is not None and "decode_ms_per_tok" in entry:
            cost = selection_cost(b, t)
            step = entry["decode_ms_per_tok"]
            entry.update(cost, selection_share_of_step=round(cost["selection_ms_per_step"] / step, 4) if step else None)
            if step and "selection_ms_per_step_graph" in cost:
                entry["selection_share_of_step_graph"] = round(cost["selection_ms_per_step_graph"] / step, 4)
            _save(args.out, data)
            log(f"T={t} selection on the device: {cost}")
    if args.many_sessions:
        hbm_gb = args.many_hbm_gb or sizes.many_hbm_gb
        log(f"many sessions: {args.many_sessions} x {many_context} tokens, {hbm_gb} GB of HBM for KV")
        try:
            skip = time.monotonic() > b.deadline
            many = {"skipped": "time budget spent"} if skip else run_many(b, args.many_sessions, many_context, hbm_gb)
        except Exception as exc:
            many = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        _free()
        data["many_sessions"] = many
        _save(args.out, data)
        log(f"many sessions: {many}")
    log(f"done in {time.monotonic() - start:.0f} s; JSON in {args.out}")
    return data


def main() -> None:
    args = parse_args()
    if args.from_json:
        runs = [json.loads(p.read_text()) for p in args.from_json]
        data, commands = merge(runs), [command(r) for r in runs]
    else:
        data = measure(args)
        commands = [command(data)]
    if args.write:
        write_section(args.write, section(data, commands), MARK)
    print(table(data), flush=True)


if __name__ == "__main__":
    main()
