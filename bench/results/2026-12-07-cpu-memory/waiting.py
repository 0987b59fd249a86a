"""In process, on the CPU: SESSIONS sessions of CTX tokens decoding together (TOKENS each) where
their KV is 1.3 x what HBM and DDR hold (the archive holds the rest, roomy), a LAYERS-layer tiny
model; with the decode steps bounded by HBM and DDR (`Engine.waiting_for_memory`: the default)
and without (`--unbounded`). Prints the steps, the blocks read back from the archive during the
generations (and by each step), and the wall time. Run from the repository root:

    python bench/results/2026-12-07-cpu-memory/waiting.py WORK LAYERS SESSIONS CTX TOKENS [--unbounded] [--archive X]

`--archive X`: `ssd_capacity_mb` at X times the sessions' KV (else `auto`, the disk's room).
"""

import dataclasses
import sys
import time
from pathlib import Path

from h3d.bench.serve import Shape, prompt, tokenizer_config, write_model
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import TokenDelta
from h3d.errors import OutOfBlocks

tok = Path("data/models/smollm2-135m-instruct")
work, layers, sessions, ctx, tokens = Path(sys.argv[1]), *map(int, sys.argv[2:6])
unbounded = "--unbounded" in sys.argv
archive = float(sys.argv[sys.argv.index("--archive") + 1]) if "--archive" in sys.argv else None
if unbounded:
    Engine._memory_blocks = lambda self: None  # type: ignore[method-assign]
shape = Shape.pick(True, tokenizer_config(tok))
shape = dataclasses.replace(shape, model=dict(shape.model, num_hidden_layers=layers))
mdir = work / f"model-{layers}"
if not mdir.is_dir():
    write_model(mdir, shape, tok, 0)
kv_mb = sessions * ctx * layers * 2 * 16 * 2 * 4 / 2**20  # 2 KV heads of 16, K and V, fp32
data = work / ("unbounded" if unbounded else "bounded")
cfg = EngineConfig.build(
    model=str(mdir), ssd_path=str(data / "archive"), session_log_path=str(data / "sessions"), block_size=32,
    prefill_chunk_tokens=ctx, hbm_mb=0.45 * kv_mb, ddr_mb=0.35 * kv_mb,
    **({"ssd_capacity_mb": archive * kv_mb} if archive else {}),
)
e = Engine(cfg)
vocab = shape.model["vocab_size"]
sids = [e.create_session() for _ in range(sessions)]
for i, sid in enumerate(list(sids)):
    try:
        e.append(sid, token_ids=prompt(vocab, ctx, 1000 + i))
    except OutOfBlocks as err:  # (the tiers cannot hold it: left out)
        print(f"session {i + 1} refused: {err}")
        sids.remove(sid)
read0 = e.tier_stats().ssd_read_count
rids = [e.submit(sid, generate=True, params=SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        for sid in sids]
out: dict[int, list[int]] = {r: [] for r in rids}
steps, waited, t0 = 0, 0, time.perf_counter()
per_step = []  # blocks read back from the archive by each step
while e.requests():
    e.upkeep()
    before = e.tier_stats().ssd_read_count
    for ev in e.step():
        if isinstance(ev, TokenDelta):
            out[ev.request_id].append(ev.token_id)
    steps += 1
    per_step.append(e.tier_stats().ssd_read_count - before)
    waited = max(waited, len(getattr(e, "waiting_for_memory", ())))
wall = time.perf_counter() - t0
st = e.tier_stats()
tag = ("unbounded" if unbounded else "bounded") + (f", archive {archive} x KV" if archive else "")
print(f"{tag}: {len(sids)} of {sessions} x {ctx} tokens, {layers} layers, KV {kv_mb:.0f} MiB "
      f"(HBM + DDR {0.8 * kv_mb:.0f} MiB): {steps} steps, {wall:.1f} s, {len(sids) * tokens / wall:.1f} tokens/s, "
      f"blocks read from the archive {st.ssd_read_count - read0}, most waiting {waited}, "
      f"tokens hash {hash(tuple(tuple(v) for v in out.values()))}; read by each step: {per_step}")
e.close()
