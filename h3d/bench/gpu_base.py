"""The GPU benchmark's parts that every kind of run shares (`h3d.bench.gpu`): its sizes, its state,
the model with random weights, the timers and the device ceilings and probes.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from h3d.config import EngineConfig
from h3d.engine.runner import ModelRunner
from h3d.hbf.digests import block_scores
from h3d.model.config import ModelConfig, parse_model_config
from h3d.model.llama import CausalLM
from h3d.model.rope import RotaryEmbedding
from h3d.tiers.stats import TierCounters

BLOCK = 32
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
        # The mode: a 2,048-token window, held there (random weights give the entropy no
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
        save(self.args.out, self.data)


def log(msg: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def version(dist: str) -> str | None:
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


def param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


# ---- ceilings --------------------------------------------------------------------------------


def median_s(fn: Callable[[], object], reps: int, cuda: bool, warm: int = 3) -> float:
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


def device_times_us(prof: Any) -> tuple[dict[str, float], float]:
    """A finished `torch.profiler` run's device time: microseconds per kernel name, and of the
    copies and memsets together."""
    kernels: dict[str, float] = {}
    copies = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            us = e.time_range.elapsed_us()
            if "memcpy" in e.name.lower() or "memset" in e.name.lower():
                copies += us
            else:
                kernels[e.name] = kernels.get(e.name, 0.0) + us
    return kernels, copies


def copy_s(src: torch.Tensor, device: torch.device, reps: int) -> float:
    """Median seconds of one copy of `src` into a buffer on `device` (non-blocking from pinned memory)."""
    dst = torch.empty(src.shape, dtype=src.dtype, device=device)
    return median_s(lambda: dst.copy_(src, non_blocking=True), reps, device.type == "cuda")


def ceilings(copy_bytes: int, h2d_bytes: int, device: torch.device) -> dict[str, float | None]:
    """HBM copy GB/s (read + write) of `copy_bytes` and pinned H2D GB/s of `h2d_bytes`; on the
    CPU, a DRAM copy and no H2D."""
    cuda = device.type == "cuda"
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).normal_()
    hbm = 2 * copy_bytes / copy_s(src, device, 20) / 1e9
    h2d = None
    if cuda:
        host = torch.empty(h2d_bytes // 4, dtype=torch.float32, pin_memory=True).normal_()
        h2d = h2d_bytes / copy_s(host, device, 10) / 1e9
    del src
    free_memory()
    return {"hbm_copy_gbps": round(hbm, 1), "h2d_gbps": None if h2d is None else round(h2d, 2)}


# ---- measuring -------------------------------------------------------------------------------


class Peak:
    """GPU memory allocated beyond what was resident when built (the weights), at its peak."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            free_memory()
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
    c1, lats = runner.tiers.counters, runner.kv.promoter.latencies_us[lat0:]
    hits, misses = c1.hbm_hits - c0.hbm_hits, c1.hbm_misses - c0.hbm_misses
    return {
        "hbm_hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        "fetch_gb_per_step": round((c1.fetch_bytes - c0.fetch_bytes) / steps / 1e9, 4),
        "promote_gb_per_step": round((c1.promote_count - c0.promote_count) * runner.hbm.slot_bytes / steps / 1e9, 4),
        "hbf_latency_us_p50": round(float(np.median(lats)), 1) if lats else None,  # exact: no planning
    }


# ---- attention_entropy's selection, alone ------------------------------------------------------


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

    per_layer = median_s(once, repeats, b.device.type == "cuda", warm=10) * 1e6
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
            step = median_s(graph.replay, 50, True) * 1e3
            out["selection_ms_per_step_graph"] = round(step, 3)
        except RuntimeError as exc:  # capture refused: the eager figures stand alone
            out["selection_graph_error"] = str(exc)[:200]
    return out
