"""Where a long append and a decode step spend their device time: the engine at the daemon's
defaults against transformers, in one process, under `torch.profiler`.

    python -m h3d.bench.profile [--tokenizer DIR] [--context 131072] [--no-hf] [--out DIR] [--tiny]

Writes the model folder of `h3d.bench.serve` (the Llama-3-8B shape, random bf16 weights, reused
when current), builds an in-process `Engine` with nothing set but the model and its archive and
logs (what `h3d serve` runs with its defaults), and times, one after another:

- an `exact` append of `--context` tokens, twice, then once with no pause between its pieces
  (`prefill_step_ms` out of reach), then once under the profiler;
- 80 greedy tokens of an `exact` session at a quarter of that context (inter-token p50), then 33
  more under the profiler: the kernels' time per token against the wall time;
- transformers' `LlamaForCausalLM` (sdpa, `DynamicCache`) on the same weights: the same prompt's
  forward, twice, then once under the profiler (`--no-hf` skips it).

`OUT/profile.json` holds the figures; `OUT/<name>.txt` the profiler's table of each profiled part
(sorted by the device's own time). Device time is the sum of the kernels' durations (copies and
memsets apart, `copies_s`). `--tiny`: the tiny shape on the CPU (the code path, not figures: the
CPU profile has no device time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from h3d.bench import serve
from h3d.bench.gpu_base import device_times_us, free_memory


def log(msg: str) -> None:
    print(f"[profile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Profiled:
    """One part's profile: its table written to OUT, its kernels' and copies' time summed."""

    def __init__(self, out: Path, cuda: bool) -> None:
        self.out, self.cuda = out, cuda
        self.figures: dict[str, Any] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> tuple[Any, float]:
        """fn() under the profiler; (its result, its kernels' seconds)."""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as p:
            result = fn()
        key = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        table = p.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70)
        (self.out / f"{name}.txt").write_text(table)
        by_name, copies = device_times_us(p)
        kernels = sum(by_name.values())
        self.figures.setdefault("copies_s", {})[name] = round(copies / 1e6, 3)
        return result, kernels / 1e6


def _engine_part(prof: Profiled, model_dir: Path, data: Path, ids: list[int], device: torch.device) -> None:
    """The engine's append and decode (see the module docstring), into `prof.figures`."""
    from h3d.config import EngineConfig
    from h3d.engine.engine import Engine
    from h3d.engine.session import TokenDelta

    res, context = prof.figures, len(ids)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    shutil.rmtree(data, ignore_errors=True)
    paths = {"ssd_path": str(data / "archive"), "session_log_path": str(data / "sessions")}
    engine = Engine(EngineConfig.build(model=str(model_dir), device=device.type, **paths))
    engine.warm()

    def append(n: int = context) -> tuple[Any, float]:
        sid = engine.create_session(policy="exact")
        sync()
        t0 = time.perf_counter()
        engine.append(sid, token_ids=ids[:n])
        sync()
        return sid, time.perf_counter() - t0

    def timed_append() -> float:
        sid, seconds = append()
        engine.close_session(sid, purge=True)
        return round(seconds, 3)

    res["engine_append_s"] = [timed_append() for _ in range(2)]
    step_s = engine.interleave.step_s
    engine.interleave.step_s = float("inf")
    res["engine_append_one_go_s"] = timed_append()
    engine.interleave.step_s = step_s
    res["engine_append_profiled_s"], kernels = prof.run("engine_append", timed_append)
    res["engine_append_device_s"] = round(kernels, 3)
    log(f"engine append of {context}: {res['engine_append_s']} s, in one go {res['engine_append_one_go_s']} s")

    sid, _ = append(context // 4)
    arrivals: list[float] = []
    params = engine.with_sampling(max_tokens=80, temperature=0.0, ignore_eos=True)
    for event in engine.generate(sid, token_ids=[ids[0]], params=params):
        if isinstance(event, TokenDelta):
            arrivals.append(time.perf_counter())
    gaps = sorted((b - a) * 1e3 for a, b in itertools.pairwise(arrivals[1:]))  # from the second token on
    res["decode_itl_ms_p50"] = round(gaps[len(gaps) // 2], 3)
    params = engine.with_sampling(max_tokens=33, temperature=0.0, ignore_eos=True)

    def decode() -> float:
        t0 = time.perf_counter()
        n = sum(isinstance(e, TokenDelta) for e in engine.generate(sid, token_ids=[ids[1]], params=params))
        sync()
        return (time.perf_counter() - t0) / n

    per_token, kernels = prof.run("decode", decode)
    res["decode_wall_ms_per_token"] = round(per_token * 1e3, 3)
    res["decode_device_ms_per_token"] = round(kernels * 1e3 / 33, 3)
    log(f"exact decode at {context // 4}: p50 {res['decode_itl_ms_p50']} ms; profiled "
        f"{res['decode_wall_ms_per_token']} ms/token, kernels {res['decode_device_ms_per_token']}")  # fmt: skip
    engine.close_session(sid, purge=True)
    engine.close()


def _hf_part(prof: Profiled, shape: serve.Shape, ids: list[int], device: torch.device) -> None:
    """transformers' forward of the same prompt on the same weights, into `prof.figures`."""
    from h3d.bench.gpu_hf import build_hf, hf_prefill

    res, context = prof.figures, len(ids)
    model = build_hf(shape.model, shape.dtype, device, 0)

    def forward(n: int = context) -> float:
        return round(hf_prefill(model, ids[:n], device)[0], 3)

    forward(min(1024, context))  # a warm-up
    res["hf_prefill_s"] = [forward() for _ in range(2)]
    res["hf_prefill_profiled_s"], kernels = prof.run("hf_prefill", forward)
    res["hf_prefill_device_s"] = round(kernels, 3)
    log(f"transformers forward of {context}: {res['hf_prefill_s']} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", type=Path, default=serve.DEFAULT_TOKENIZER, help="folder with the tokenizer's files")
    p.add_argument("--context", type=int, default=0, help="tokens of the append (default 131072; --tiny 2048)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--work", type=Path, default=Path(".bench/serve"), help="where the model folder is written")
    p.add_argument("--out", type=Path, default=Path(".bench/profile"), help="folder of the JSON and the tables")
    p.add_argument("--tiny", action="store_true", help="the tiny shape on the CPU: the code path only")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    shape = serve.Shape.pick(args.tiny, serve.tokenizer_config(args.tokenizer))
    model_dir = args.work / ("model-tiny" if args.tiny else "model-llama3-8b-shape")
    serve.write_model(model_dir, shape, args.tokenizer, 0)
    context = args.context or (2048 if args.tiny else 131072)
    ids = serve.prompt(int(shape.model["vocab_size"]), context, context)
    args.out.mkdir(parents=True, exist_ok=True)
    prof = Profiled(args.out, cuda)
    res = prof.figures
    res.update(context=context, card=torch.cuda.get_device_name(0) if cuda else "cpu", command=" ".join(sys.argv))

    _engine_part(prof, model_dir, args.work / "profile-data", ids, device)
    free_memory()

    if not args.no_hf:
        _hf_part(prof, shape, ids, device)
        free_memory()

    (args.out / "profile.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
