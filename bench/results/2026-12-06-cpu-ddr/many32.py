"""In process: 32 sessions decoding together with HBM and DDR as tight as the H200's many
(KV = 0.87 of HBM + DDR, HBM 0.75 of the KV), a 32-layer tiny model; cProfile of the steps."""
import cProfile, dataclasses, pstats, sys, time
from pathlib import Path
import numpy as np
from h3d.bench.serve import Shape, tokenizer_config, write_model, prompt
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams

tok = Path("data/models/smollm2-135m-instruct")
work = Path(sys.argv[1]); layers = int(sys.argv[2]); sessions = int(sys.argv[3]); ctx = int(sys.argv[4])
tight = sys.argv[5] == "tight"
shape = Shape.pick(True, tokenizer_config(tok))
model = dict(shape.model, num_hidden_layers=layers)
shape = dataclasses.replace(shape, model=model)
mdir = work / f"model-{layers}"
write_model(mdir, shape, tok, 0)
kv_bytes = sessions * ctx * layers * 2 * 16 * 2 * 4  # 2 kv heads, head 16, K+V, fp32
mb = kv_bytes / 2**20
kw = dict(hbm_mb=0.75 * mb, ddr_mb=0.40 * mb, ssd_capacity_mb=0.28 * mb, write_behind_dirty_mb=0.05 * mb) if tight else dict(hbm_mb=4 * mb, ddr_mb=4 * mb)
cfg = EngineConfig.build(model=str(mdir), ssd_path=str(work / "archive"), session_log_path=str(work / "sessions"),
                         block_size=32, prefill_chunk_tokens=ctx, **kw)
e = Engine(cfg)
vocab = model["vocab_size"]
sids = [e.create_session() for _ in range(sessions)]
t0 = time.perf_counter()
for i, sid in enumerate(sids):
    e.append(sid, token_ids=prompt(vocab, ctx, 1000 + i))
print(f"appends {time.perf_counter() - t0:.1f} s", flush=True)
def occ(tag):
    b = e.kv.blocks
    hcap = b.hbm_capacity; hfree = int(b.hbm_alloc.free.sum())
    dcap = b.ddr_alloc.capacity; dfree = b.ddr_free
    ent = b.entries
    live = []
    for s_ in sids:
        t = b.table(e.session(s_).seq); ids = t.ids[:, : t.num_blocks]; live.append(ids.ravel())
    ids = np.concatenate(live)
    inh = (ent.hbm[ids] >= 0); ind = (ent.ddr[ids] >= 0)
    print(f"{tag}: blocks {len(ids)} hbm {hcap - hfree}/{hcap} ddr {dcap - dfree}/{dcap} both {int((inh & ind).sum())} ddr-only {int((~inh & ind).sum())} archive-only {int((~inh & ~ind).sum())}", flush=True)
occ("after appends")
for sid in sids:
    e.submit(sid, generate=True, params=SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
pr = cProfile.Profile()
times = []
while e.requests():
    t0 = time.perf_counter()
    pr.enable(); e.upkeep(); e.step(); pr.disable()
    times.append(time.perf_counter() - t0)
    if len(times) % 6 == 0: occ(f"step {len(times)}")
st = e.tier_stats()
print("step ms p50 %.1f max %.1f" % (np.median(times) * 1e3, max(times) * 1e3), "steps", len(times))
print({k: getattr(st, k) for k in ("hbm_rebalance_count", "ddr_evict_count", "ssd_write_count", "ssd_read_count", "promote_count")})
pstats.Stats(pr).sort_stats("cumulative").print_stats(r"tiers|writebehind|manager|shares|promotion", 30)
