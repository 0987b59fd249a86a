"""A chat's second turn in process, where its time goes: the engine at the daemon's defaults on the
Llama-3-8B-shaped model folder (random weights) that `bench/gpu-host.sh chat` writes; turn 1 a
32,807-token prompt and 32 tokens, its session retired (the OpenAI path); then turns 2 over the
whole history plus 51 new tokens, each to its first token (max_tokens 1) and retired: right after
turn 1, then once write-behind settled: plain, with the step's phases timed, under cProfile, under
torch.profiler. Run from the repository root: python3 bench/results/2026-12-07-gpu-h/turn2.py OUT
"""

import cProfile
import gzip
import io
import json
import pstats
import random
import shutil
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from h3d.bench.serve import COMMIT_PARTS, STEP_PHASES, Shape, timed_phases, tokenizer_config, write_model
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.session import TokenDelta

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok, model = Path(".bench/tok"), Path(".bench/serve/model-llama3-8b-shape")
tiny = not torch.cuda.is_available()  # (the script's check on a CPU: a tiny model, a short prompt)
if tiny:
    model = Path(".bench/turn2-tiny-model")
if not model.is_dir():
    write_model(model, Shape.pick(tiny, tokenizer_config(tok)), tok, 0)
sync = torch.cuda.synchronize if not tiny else (lambda: None)
data = Path(".bench/turn2")
shutil.rmtree(data, ignore_errors=True)
t0 = time.perf_counter()
engine = Engine(EngineConfig.build(model=str(model), device="cpu" if tiny else "cuda", ssd_path=str(data / "archive"),
                                   session_log_path=str(data / "sessions")))
engine.warm()
res: dict = {"start_s": round(time.perf_counter() - t0, 1), "device": "cpu" if tiny else torch.cuda.get_device_name()}
rng = random.Random(0)
vocab = 49152
prompt = [rng.randrange(100, vocab) for _ in range(600 if tiny else 32807)]


def turn(ids: list[int], max_tokens: int) -> tuple[float, object]:
    sid = engine.create_session()
    sync()
    t = time.perf_counter()
    rid = engine.submit(sid, token_ids=ids, generate=True,
                        params=engine.with_sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    first = None
    for ev in engine.run(rid):
        if isinstance(ev, TokenDelta) and first is None:
            first = time.perf_counter() - t
    return first, sid


first_s, a = turn(prompt, 32)
history = list(engine.session(a).tokens)
engine.retire(a)
res["turn1_ttft_s"] = round(first_s, 3)


def second(tag: str, wrap=None) -> None:
    ids = history + [rng.randrange(100, vocab) for _ in range(51)]
    phases = dict.fromkeys(STEP_PHASES + COMMIT_PARTS, 0.0)
    before = engine.counters.steps
    if wrap == "phases":
        with timed_phases(engine, phases):
            s, sid = turn(ids, 1)
    elif wrap == "cprofile":
        pr = cProfile.Profile()
        pr.enable()
        s, sid = turn(ids, 1)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(70)
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(40)
        (out / f"{tag}-cprofile.txt").write_text(buf.getvalue())
    elif wrap == "torch":
        acts = [ProfilerActivity.CPU] + ([] if tiny else [ProfilerActivity.CUDA])
        with profile(activities=acts) as p:
            s, sid = turn(ids, 1)
        ka = p.key_averages()
        by_device = "" if tiny else ka.table(sort_by="self_cuda_time_total", row_limit=45)
        (out / f"{tag}-torch.txt").write_text(by_device + "\n\n" + ka.table(sort_by="cpu_time_total", row_limit=45))
        p.export_chrome_trace(str(out / f"{tag}-trace.json"))
        with open(out / f"{tag}-trace.json", "rb") as f, gzip.open(out / f"{tag}-trace.json.gz", "wb") as z:
            shutil.copyfileobj(f, z)
        (out / f"{tag}-trace.json").unlink()
    else:
        s, sid = turn(ids, 1)
    cached = engine.counters.prefix_reused_tokens
    engine.retire(sid)
    res[tag] = {"ttft_ms": round(s * 1e3, 2), "steps": engine.counters.steps - before,
                "prefix_reused_tokens_total": cached, "dirty_gb": round(engine.tier_stats().dirty_bytes / 1e9, 2)}
    if wrap == "phases":
        res[tag]["phases_ms"] = {k: round(v * 1e3, 2) for k, v in phases.items()}
    print(tag, res[tag], flush=True)


second("right_after_phases", "phases")
second("right_after_2")
t = time.perf_counter()
while engine.write_behind():
    time.sleep(0.01)
res["settle_s"] = round(time.perf_counter() - t, 2)
time.sleep(1.0)
for i in range(3):
    second(f"settled_{i}")
second("settled_phases", "phases")
second("settled_cprofile", "cprofile")
second("settled_torch", "torch")
(out / "turn2.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res), flush=True)
engine.close()
