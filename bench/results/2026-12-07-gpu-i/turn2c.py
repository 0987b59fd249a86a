"""A chat's second turn in process, the segments (`attention.segmented_attention`) against the
copying path on the same state, alternated, with where the cached prefix lies each time (runs of
slots, blocks in DDR, of the chunk's attention at layer 1). Otherwise as turn2b.py: the engine at
the daemon's defaults on the Llama-3-8B-shaped model folder (random weights) that
`bench/gpu-host.sh chat` writes; turn 1 a 32,807-token prompt and 32 tokens, its session retired;
turns 2 over the whole history plus 51 new tokens, to the first token, retired. Run from the
repository root: python3 bench/results/2026-12-07-gpu-i/turn2c.py OUT
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
from h3d.kv import attention

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok, model = Path(".bench/tok"), Path(".bench/serve/model-llama3-8b-shape")
tiny = not torch.cuda.is_available()
if tiny:
    model = Path(".bench/turn2-tiny-model")
if not model.is_dir():
    write_model(model, Shape.pick(tiny, tokenizer_config(tok)), tok, 0)
sync = torch.cuda.synchronize if not tiny else (lambda: None)
data = Path(".bench/turn2c")
shutil.rmtree(data, ignore_errors=True)
engine = Engine(EngineConfig.build(model=str(model), device="cpu" if tiny else "cuda", ssd_path=str(data / "archive"),
                                   session_log_path=str(data / "sessions")))
engine.warm()
res: dict = {"device": "cpu" if tiny else torch.cuda.get_device_name(), "turns": []}
rng = random.Random(0)
vocab = 49152
prompt = [rng.randrange(100, vocab) for _ in range(600 if tiny else 32807)]
seen: list = []
orig = attention._segments


def spy(pools, runs):
    seen.append((len(runs), sum(c for t, _, c in runs if t == 1), sum(c for _, _, c in runs)))
    return orig(pools, runs)


attention._segments = spy


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


def settle() -> float:
    t = time.perf_counter()
    while engine.write_behind():
        time.sleep(0.01)
    time.sleep(1.0)
    return round(time.perf_counter() - t, 2)


def second(tag: str, history: list[int], segments: bool) -> None:
    attention.chunk_segments = segments
    ids = history + [rng.randrange(100, vocab) for _ in range(51)]
    phases = dict.fromkeys(STEP_PHASES + COMMIT_PARTS, 0.0)
    seen.clear()
    dirty = engine.tier_stats().dirty_bytes
    with timed_phases(engine, phases):
        s, sid = turn(ids, 1)
    engine.retire(sid)
    row = {"tag": tag, "segments": segments, "ttft_ms": round(s * 1e3, 2), "dirty_gb": round(dirty / 1e9, 2),
           "execute_ms": round(phases["execute"] * 1e3, 2), "commit_ms": round(phases["commit"] * 1e3, 2),
           "runs_ddr_blocks_layer1": seen[2:4], "calls": len(seen)}
    res["turns"].append(row)
    print(row, flush=True)


first_s, a = turn(prompt, 32)
history = list(engine.session(a).tokens)
engine.retire(a)
res["turn1_ttft_s"] = round(first_s, 3)
second("right_after", history, True)
second("right_after", history, False)
res["settle_s"] = settle()
for i in range(4):
    second(f"settled_{i}", history, i % 2 == 0)
    second(f"settled_{i}", history, i % 2 == 1)
(out / "turn2c.json").write_text(json.dumps(res, indent=1))
engine.close()
