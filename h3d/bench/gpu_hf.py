"""The GPU benchmark's baselines: transformers' LlamaForCausalLM (sdpa) with a DynamicCache, and with
the offloaded one, built from the same config.json dict as h3d's model (`h3d.bench.gpu`).
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from h3d.bench.gpu_base import Bench, Peak, decode_fields, log, randomize, run_steps
from h3d.bench.gpu_report import WARMUP


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


def forward_kw(model: torch.nn.Module) -> tuple[str, dict[str, Any]]:
    """The name of the cache argument of transformers' forward ("cache" in later 5.x, else
    "past_key_values") and the keyword that keeps only the last position's logits, if it has one."""
    params = inspect.signature(model.forward).parameters
    kw = "cache" if "cache" in params else "past_key_values"
    return kw, ({"logits_to_keep": 1} if "logits_to_keep" in params else {})


@torch.inference_mode()
def hf_prefill(model: torch.nn.Module, ids: list[int], device: torch.device) -> tuple[float, torch.Tensor, Any]:
    """transformers' forward of `ids` into a fresh `DynamicCache`, timed with the device synced:
    (seconds, the next greedy token [1, 1], the cache)."""
    import transformers

    kw, keep = forward_kw(model)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cache = transformers.DynamicCache()
    x = torch.tensor([ids], device=device)
    sync()
    t0 = time.perf_counter()
    tok = model(input_ids=x, use_cache=True, **{kw: cache}, **keep).logits[:, -1:].argmax(-1)
    sync()
    return time.perf_counter() - t0, tok, cache


@torch.inference_mode()
def hf_generate(b: Bench, cache: Any, ids: list[int], steps: int) -> tuple[float, list[float]]:
    """Prefill `ids` in one forward into `cache`, then greedy decode: (prefill seconds, timed step seconds)."""
    assert b.hf is not None
    model = b.hf
    kw, keep = forward_kw(model)
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
