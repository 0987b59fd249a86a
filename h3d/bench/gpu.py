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

# Here: the modes planned and run. `h3d.bench.gpu_base`: sizes, state, model, timers, ceilings;
# `h3d.bench.gpu_hf`: the transformers baselines; `h3d.bench.gpu_report`: the tables, from the JSON.
from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from h3d.bench.gpu_base import (
    BLOCK,
    Bench,
    Peak,
    Sizes,
    build_h3d,
    ceilings,
    decode_fields,
    free_memory,
    log,
    param_bytes,
    run_steps,
    save,
    selection_cost,
    tier_fields,
    version,
)
from h3d.bench.gpu_hf import run_hf
from h3d.bench.gpu_report import H3D_MODES, HF_MODES, MARK, MODES, WARMUP, command, merge, section, summary, table
from h3d.bench.report import write_section
from h3d.config import EngineConfig
from h3d.engine.runner import ModelRunner
from h3d.engine.step import Chunk
from h3d.hbf.policy import HbfConfig, policy_named
from h3d.kv.blocks import SeqId
from h3d.kv.sizing import PoolPlan, plan_pools, slot_bytes
from h3d.model.config import ModelConfig

PROMOTE_MB = EngineConfig().promote_mb_per_step  # the daemon's default


class PrefillOOM(Exception):
    pass


def plan(
    cfg: ModelConfig, sizes: Sizes, mode: str, tokens: int, steps: int, sessions: int = 1, hbm_bytes: int = 0
) -> tuple[PoolPlan, HbfConfig]:
    """A mode's pools, sized as the engine sizes its own (`plan_pools`) from the settings that make
    the mode, and its HBF config: for `sessions` of `tokens` tokens that then decode `steps` (+
    warm-up) tokens."""
    nl, elem = cfg.num_layers, sizes.dtype.itemsize
    nb = sessions * -(-(tokens + WARMUP + steps + 1) // BLOCK)  # every block the run writes
    slot = slot_bytes(BLOCK, cfg.num_kv_heads, cfg.head_dim, elem)

    def mib(slots: int) -> float:
        return slots * slot / 2**20

    heads, dim = cfg.num_kv_heads, cfg.head_dim
    pools = partial(plan_pools, block_size=BLOCK, num_layers=nl, num_kv_heads=heads, head_dim=dim, elem_bytes=elem)

    mode = mode.removesuffix("_eager")
    exact = replace(EngineConfig(), policy="exact").hbf
    if mode == "exact_full":  # every block the run writes in HBM (+2 a layer), equal regions
        return pools(mib((nb + 2) * nl), mib(4 * nl)), exact
    if mode == "exact_25pct":  # a quarter of the prompt's blocks in HBM, the rest in DDR
        hbm = max(1, math.ceil(-(-tokens // BLOCK) / 4))
        return pools(mib(hbm * nl), mib((nb - hbm) * nl + 4 * nl)), exact
    # The budget holds the digests too (they stay in HBM): the pool gets what they leave.
    hbf = replace(EngineConfig(), policy="attention_entropy", **sizes.hbf).hbf
    digest_bytes = nb * max(1, BLOCK // hbf.digest_tokens) * nl * cfg.num_kv_heads * 2 * cfg.head_dim * elem
    hbm_mb = ((hbm_bytes or sizes.entropy_hbm_bytes) - digest_bytes) / 2**20
    # The dense layers read every block at every step: their regions hold all of them (at most
    # half of the pool, `dense_hbm_share`), the other layers share the rest; no region holds more
    # than the run writes (+2).
    dense = min(hbf.dense_layers, nl - 1)
    sparse = partial(pools, hbm_mb, dense_layers=dense, dense_hbm_share=0.5, max_region_slots=nb + 2)
    held = sum(min(r, nb) for r in sparse(0.0).regions)
    # DDR: every block HBM does not hold, plus room for copies of half of HBM's (HBF's victims keep
    # one); a 32nd with many sessions, whose DDR (pinned) must fit in the host's memory (a victim
    # with no room for its copy stays in HBM).
    ddr = nb * nl - held + math.ceil(held / (2 if sessions == 1 else 32)) + 4 * nl * sessions
    return sparse(mib(ddr)), hbf


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
            logits = runner.step([Chunk(seq, tuple(ids[a:e]), a, want_logits=e == len(ids), final=e == len(ids))])
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
        free_memory()
        chunk //= 2


def _h3d_once(b: Bench, mode: str, ids: list[int], chunk: int, steps: int) -> dict[str, Any]:
    t = len(ids)
    pools, hbf = plan(b.cfg, b.sizes, mode, t, steps)
    hbm, ddr = pools.regions, pools.ddr_slots
    peak = Peak(b.device)
    runner = ModelRunner(
        b.model, hbm, ddr, BLOCK, archive=None, high_watermark=0.85, hbf=hbf, promote_mb_per_step=PROMOTE_MB
    )
    runner.graphs.enabled = runner.graphs.enabled and not mode.endswith("_eager")
    seq = SeqId(1)
    runner.kv.open(seq)
    if policy_named(hbf.policy).keeps_digests:
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
        logits = runner.step([Chunk(seq, (tok,), pos, True)])[0]
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
    before = replace(runner.tiers.counters), len(runner.kv.promoter.latencies_us)
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
    if policy_named(hbf.policy).keeps_digests and ceil.get("h2d_gbps") and ceil.get("hbm_copy_gbps"):
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
    pools, hbf = plan(b.cfg, b.sizes, "exact_full", len(ids), 0)
    runner = ModelRunner(b.model, pools.regions, pools.ddr_slots, BLOCK, archive=None, high_watermark=0.85, hbf=hbf)
    runner.kv.open(SeqId(1))
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
    free_memory()
    log(f"warm-up done in {time.monotonic() - t0:.1f} s")


# ---- many sessions -------------------------------------------------------------------------------


def run_many(b: Bench, n: int, context: int, hbm_gb: float) -> dict[str, Any]:
    """n sessions of `context` tokens, prefilled one by one, then decoding together: one execute per step."""
    pools, hbf = plan(b.cfg, b.sizes, "attention_entropy", context, b.args.steps, n, int(hbm_gb * 1e9))
    hbm, ddr = pools.regions, pools.ddr_slots
    peak = Peak(b.device)
    slot = slot_bytes(BLOCK, b.cfg.num_kv_heads, b.cfg.head_dim, b.model.lm_head.weight_t.element_size())
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
        runner.kv.open(seq)
        runner.digests.reserve(seq, -(-(context + WARMUP + b.args.steps + 1) // BLOCK))
        ids = torch.randint(0, b.cfg.vocab_size, (context,), generator=gen).tolist()
        s, tok = prefill(b, runner, seq, ids, b.args.prefill_chunk or b.sizes.prefill_chunk)
        prefill_s += s
        toks.append(tok)
        log(f"many sessions: prefilled {seq} of {n} in {s:.2f} s")
    pos = context

    def step(cur: list[int]) -> list[int]:
        nonlocal pos
        logits = runner.step([Chunk(s, (t,), pos, True) for s, t in zip(seqs, cur, strict=True)])
        pos += 1
        return [int(x) for x in logits.argmax(-1).tolist()]

    _, _, toks = run_steps(b, step, toks, WARMUP, stop=False)
    before = replace(runner.tiers.counters), len(runner.kv.promoter.latencies_us)
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


def run_batch_change(b: Bench, context: int) -> dict[str, Any]:
    """Three sessions of `context` tokens under attention_entropy, decoding in batches whose members
    change: other sessions in the same slots, the same ones in other slots, one alone, all three.
    Counted: the captures made at steps whose batch is new while no new graph was made (its shape
    had one already): 0 when a graph depends on shapes only."""
    n = 3
    schedule = [(1, 2), (2, 3), (3, 1), (2, 1), (1,), (2,), (3,), (1, 2, 3), (3, 2, 1), (2, 3, 1), (1, 2), (3,)]
    pools, hbf = plan(b.cfg, b.sizes, "attention_entropy", context, len(schedule), n)
    runner = ModelRunner(
        b.model, pools.regions, pools.ddr_slots, BLOCK, archive=None, high_watermark=0.85, hbf=hbf,
        promote_mb_per_step=PROMOTE_MB,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(b.args.seed + 11)
    tok, pos = {}, {}
    for i in range(1, n + 1):
        seq = SeqId(i)
        runner.kv.open(seq)
        runner.digests.reserve(seq, -(-(context + len(schedule) + 1) // BLOCK))
        ids = torch.randint(0, b.cfg.vocab_size, (context,), generator=gen).tolist()
        _, tok[seq] = prefill(b, runner, seq, ids, b.args.prefill_chunk or b.sizes.prefill_chunk)
        pos[seq] = context
    g = runner.graphs
    seen: set[tuple[int, ...]] = set()
    changes = on_change = 0
    built, captures, replays = g.built, g.captures, g.replays
    for batch in schedule:
        seqs = [SeqId(i) for i in batch]
        before = g.built, g.captures
        logits = runner.step([Chunk(s, (tok[s],), pos[s], True) for s in seqs])
        for s, row in zip(seqs, logits, strict=True):
            tok[s], pos[s] = int(row.argmax()), pos[s] + 1
        if batch not in seen and g.built == before[0]:
            changes += 1
            on_change += g.captures - before[1]
        seen.add(batch)
    out: dict[str, Any] = {"sessions": n, "context": context, "steps": len(schedule), "batch_changes": changes}
    out.update(captures_on_batch_change=on_change, graphs_built=g.built - built, captures=g.captures - captures)
    out["graph_steps"] = g.replays - replays
    out["graph_buffers_mb"] = round(g.nbytes / 2**20, 2)  # the graphs' static buffers, host and device
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
        free_memory()
        if mode == "exact_full" and t == min(b.args.contexts) and t in b.exact_prefill:
            fields["prefill_vs_chunked"] = prefill_check(b, ids, max(b.sizes.min_prefill_chunk, t // 4))
            free_memory()
        b.record(mode, t, fields)
        log(f"T={t} {mode}: {summary(fields)} ({time.monotonic() - t0:.1f} s)")
    b.hf = None  # never two models' caches at once across contexts: rebuilt for the next one
    free_memory()


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
    data: dict[str, Any] = {"date": date, "card": card, "torch": torch.__version__, "triton": version("triton")}
    data.update(transformers=version("transformers"), ceilings={}, modes={}, many_sessions=None)
    log(f"{card}: building h3d's model {'(tiny)' if args.tiny else '(Llama-3-8B shape)'}, contexts {contexts}")
    model = build_h3d(raw, sizes.dtype, device, args.seed)
    b = Bench(args, sizes, device, raw, model, model.config, param_bytes(model), start + args.max_seconds, data)
    data["ceilings"] = ceilings(sizes.copy_bytes, sizes.h2d_bytes, device)
    save(args.out, data)
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
            save(args.out, data)
            log(f"T={t} selection on the device: {cost}")
    if "attention_entropy_3GiB" in args.modes and time.monotonic() < b.deadline:
        context = max(min(contexts) // 4, 2 * sizes.hbf["window_tokens"])  # selecting: past the window
        log(f"batch change: 3 sessions x {context} tokens")
        try:
            data["batch_change"] = run_batch_change(b, context)
        except Exception as exc:
            traceback.print_exc()
            data["batch_change"] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        free_memory()
        save(args.out, data)
        log(f"batch change: {data['batch_change']}")
    if args.many_sessions:
        hbm_gb = args.many_hbm_gb or sizes.many_hbm_gb
        log(f"many sessions: {args.many_sessions} x {many_context} tokens, {hbm_gb} GB of HBM for KV")
        try:
            skip = time.monotonic() > b.deadline
            many = {"skipped": "time budget spent"} if skip else run_many(b, args.many_sessions, many_context, hbm_gb)
        except Exception as exc:
            many = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
        free_memory()
        data["many_sessions"] = many
        save(args.out, data)
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
