"""In process: N sessions of CTX tokens (a 32-layer tiny model, the default policy) decode a few
tokens together, then close one after another as a daemon closes them (`later=True`); each
close and the engine's work between closes timed, the slowest profiled.

    python bench/results/2026-12-07-cpu-close/close.py DIR [SESSIONS CTX]
"""
import cProfile, dataclasses, pstats, sys, time
from pathlib import Path
from h3d.bench.serve import Shape, tokenizer_config, write_model, prompt
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams

tok = Path("data/models/smollm2-135m-instruct")
work = Path(sys.argv[1]); sessions = int(sys.argv[2]) if len(sys.argv) > 2 else 16
ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
shape = Shape.pick(True, tokenizer_config(tok))
shape = dataclasses.replace(shape, model=dict(shape.model, num_hidden_layers=32))
mdir = work / "model-32"
if not mdir.exists():
    write_model(mdir, shape, tok, 0)
mb = sessions * ctx * 32 * 2 * 16 * 2 * 4 / 2**20
cfg = EngineConfig.build(model=str(mdir), ssd_path=str(work / "archive"), session_log_path=str(work / "sessions"),
                         block_size=32, prefill_chunk_tokens=ctx, hbm_mb=0.75 * mb, ddr_mb=2 * mb)
e = Engine(cfg)
vocab = shape.model["vocab_size"]
sids = [e.create_session() for _ in range(sessions)]
for i, sid in enumerate(sids):
    e.append(sid, token_ids=prompt(vocab, ctx, 1000 + i))
for sid in sids:
    e.submit(sid, generate=True, params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
while e.requests():
    e.upkeep(); e.step()
rows = []
prof = cProfile.Profile()
for sid in sids:
    t0 = time.perf_counter()
    prof.enable()
    e.close_session(sid, later=True)
    t1 = time.perf_counter()
    e.upkeep(); e.write_behind()
    prof.disable()
    rows.append(((t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3))
for i, (c, u) in enumerate(rows):
    print(f"close {i}: close_session {c:.1f} ms, upkeep + write_behind {u:.1f} ms")
pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
