"""A chat's second turn in process: the first one over a cached prefix once write-behind settled (a
first use's cost, apart from write-behind's), then right after another first turn (write-behind's,
apart from a first use's). Otherwise as turn2.py: the engine at the daemon's defaults on the
Llama-3-8B-shaped model folder (random weights) that `bench/gpu-host.sh chat` writes; turn 1 a
32,807-token prompt and 32 tokens, its session retired (the OpenAI path); then turns 2 over the
whole history plus 51 new tokens, each to its first token (max_tokens 1) and retired: right after
turn 1, then once write-behind settled: plain, with the step's phases timed, under cProfile, under
torch.profiler. Run from the repository root: python3 bench/results/2026-12-07-gpu-h/turn2b.py OUT
"""

import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

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


from h3d.kernels import loader  # noqa: E402


def settle() -> float:
    t = time.perf_counter()
    while engine.write_behind():
        time.sleep(0.01)
    time.sleep(1.0)
    return round(time.perf_counter() - t, 2)


def second(tag: str, history: list[int]) -> None:
    ids = history + [rng.randrange(100, vocab) for _ in range(51)]
    phases = dict.fromkeys(STEP_PHASES + COMMIT_PARTS, 0.0)
    compiles = loader.COMPILES.count
    dirty = engine.tier_stats().dirty_bytes
    with timed_phases(engine, phases):
        s, sid = turn(ids, 1)
    engine.retire(sid)
    res[tag] = {"ttft_ms": round(s * 1e3, 2), "compiles": loader.COMPILES.count - compiles,
                "dirty_gb_before": round(dirty / 1e9, 2),
                "phases_ms": {k: round(v * 1e3, 2) for k, v in phases.items() if v}}
    print(tag, res[tag], flush=True)


first_s, a = turn(prompt, 32)
history_a = list(engine.session(a).tokens)
engine.retire(a)
res["turn1_a_ttft_s"] = round(first_s, 3)
res["settle_a_s"] = settle()
second("settled_first_ever", history_a)
second("settled_again", history_a)
second("settled_again_2", history_a)
prompt_b = [rng.randrange(100, vocab) for _ in range(len(prompt))]
first_s, b = turn(prompt_b, 32)
history_b = list(engine.session(b).tokens)
engine.retire(b)
res["turn1_b_ttft_s"] = round(first_s, 3)
second("right_after_b", history_b)
second("right_after_b_2", history_b)
res["settle_b_s"] = settle()
second("settled_b", history_b)
second("settled_b_2", history_b)
(out / "turn2b.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res), flush=True)
engine.close()
