"""A chat's second turn in process, its submit apart from its step: `Engine.submit` (on the
daemon's engine thread, the `queued_ms` of a turn that finds the engine idle: the prefix lookup,
the fork, the token log) timed and profiled on its own, then the steps to the first token. As
turn2.py otherwise (the Llama-3-8B-shaped folder `bench/gpu-host.sh chat` writes; turn 1 a
32,807-token prompt and 32 tokens, retired; turns 2 over the history plus 51 tokens, retired):
right after turn 1, then once write-behind settled. Run from the repository root:
python3 bench/results/2026-12-07-gpu-l/turn2e.py OUT
"""

import cProfile
import io
import json
import pstats
import random
import shutil
import sys
import time
from pathlib import Path

import torch

from h3d.bench.serve import Shape, tokenizer_config, write_model
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.session import TokenDelta

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
tok, model = Path(".bench/tok"), Path(".bench/serve/model-llama3-8b-shape")
tiny = not torch.cuda.is_available()
if tiny:
    model = Path(".bench/turn2-tiny-model")
if not model.is_dir():
    write_model(model, Shape.pick(tiny, tokenizer_config(tok)), tok, 0)
sync = torch.cuda.synchronize if not tiny else (lambda: None)
data = Path(".bench/turn2e")
shutil.rmtree(data, ignore_errors=True)
engine = Engine(EngineConfig.build(model=str(model), device="cpu" if tiny else "cuda", ssd_path=str(data / "archive"),
                                   session_log_path=str(data / "sessions")))
engine.warm()
res: dict = {"device": "cpu" if tiny else torch.cuda.get_device_name()}
rng = random.Random(0)
vocab = 49152
prompt = [rng.randrange(100, vocab) for _ in range(600 if tiny else 32807)]
params = engine.with_sampling(max_tokens=32, temperature=0.0, ignore_eos=True)


def turn(ids: list[int], max_tokens: int, tag: str | None = None) -> tuple[float, float, object]:
    sid = engine.create_session()
    sync()
    pr = cProfile.Profile() if tag else None
    t = time.perf_counter()
    if pr:
        pr.enable()
    rid = engine.submit(sid, token_ids=ids, generate=True,
                        params=engine.with_sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    if pr:
        pr.disable()
    submit_s = time.perf_counter() - t
    pr2 = cProfile.Profile() if tag else None
    if pr2:
        pr2.enable()
    first = None
    for ev in engine.run(rid):
        if isinstance(ev, TokenDelta) and first is None:
            first = time.perf_counter() - t
            if pr2:
                pr2.disable()
    if pr and pr2:
        buf = io.StringIO()
        buf.write("== Engine.submit, by cumulative time\n")
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(60)
        pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_callees("fork|_reuse_prefix|settle_spills")
        buf.write("== the steps to the first token, by own time\n")
        pstats.Stats(pr2, stream=buf).sort_stats("tottime").print_stats(60)
        pstats.Stats(pr2, stream=buf).sort_stats("cumulative").print_callees("commit|_save_meta")
        (out / f"{tag}-cprofile.txt").write_text(buf.getvalue())
    return first, submit_s, sid


def second(tag: str, prof: bool = False) -> None:
    ids = history + [rng.randrange(100, vocab) for _ in range(51)]
    dirty = engine.tier_stats().dirty_bytes
    first, submit_s, sid = turn(ids, 1, tag if prof else None)
    engine.retire(sid)
    res[tag] = {"ttft_ms": round(first * 1e3, 2), "submit_ms": round(submit_s * 1e3, 2),
                "dirty_gb": round(dirty / 1e9, 2), "cached": engine.counters.prefix_reused_tokens}
    print(tag, res[tag], flush=True)


first_s, submit_s, a = turn(prompt, 32)
history = list(engine.session(a).tokens)
engine.retire(a)
res["turn1"] = {"ttft_s": round(first_s, 3), "submit_ms": round(submit_s * 1e3, 2)}
second("right_after", prof=True)
second("right_after_2")
t = time.perf_counter()
while engine.write_behind():
    time.sleep(0.01)
time.sleep(1.0)
res["settle_s"] = round(time.perf_counter() - t, 2)
for i in range(3):
    second(f"settled_{i}")
second("settled_prof", prof=True)
(out / "turn2e.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res), flush=True)
engine.close()
