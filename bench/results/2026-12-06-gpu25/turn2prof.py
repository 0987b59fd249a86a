"""A chat's second turn in process: where its time goes (torch.profiler), settled and right after."""
import collections, json, random, sys, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
from h3d.bench.serve import timed_phases, STEP_PHASES, COMMIT_PARTS
from h3d.config import EngineConfig
from h3d.engine.engine import Engine

model, n, work, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
cfg = EngineConfig.build(model=model, ssd_path=str(work / "archive"), session_log_path=str(work / "sessions"),
                         write_behind_dirty_mb=1024)
e = Engine(cfg)
cuda = e.runner.device.type == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
t0 = time.perf_counter(); e.warm(); print("warm", round(time.perf_counter() - t0, 1), flush=True)
random.seed(0)
def doc(): return [random.randrange(1000, 30000) for _ in range(n)]
def first(ids, k=1):
    s = e.create_session()
    t0 = time.perf_counter(); t = None
    for ev in e.generate(s, token_ids=ids, params=e.with_sampling(max_tokens=k, ignore_eos=True)):
        if t is None: sync(); t = time.perf_counter() - t0
    return s, t
def settle():
    t0 = time.perf_counter()
    while e.write_behind() or e.kv.tiers.behind.batches:
        e.kv.tiers.behind.poll() if hasattr(e.kv.tiers.behind, "poll") else None
        time.sleep(0.01)
    return time.perf_counter() - t0
res = {}
d = doc()
s, t1 = first(d, 8); e.retire(s); res["turn1_s"] = t1; print("turn1", t1, flush=True)
tail = lambda: [random.randrange(1000, 30000) for _ in range(90)]
s, t = first(d + tail()); e.retire(s); res["right_after_s"] = t; print("right after", t, flush=True)
res["settle_s"] = settle()
for i in range(3):
    s, t = first(d + tail()); e.retire(s); res[f"settled_{i}_s"] = t; print("settled", t, flush=True)
ph = collections.defaultdict(float)
with timed_phases(e, ph):
    s, t = first(d + tail()); e.retire(s)
res["phased_s"] = t; res["phases_ms"] = {k: round(v * 1e3, 2) for k, v in ph.items()}
print(res["phases_ms"], flush=True)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
with profile(activities=acts) as prof:
    s, t = first(d + tail()); e.retire(s)
res["profiled_s"] = t
ka = prof.key_averages()
lines = ka.table(sort_by="self_cpu_time_total", row_limit=40)
if cuda: lines += "\n" + ka.table(sort_by="self_cuda_time_total", row_limit=25)
lines += "\n" + prof.key_averages(group_by_stack_n=0).table(sort_by="cpu_time_total", row_limit=60)
(out.parent / "turn2prof.txt").write_text(lines)
# every host sync of a settled turn, with where it came from
if cuda:
    import traceback, warnings
    seen = collections.Counter()
    def note(message, category, filename, lineno, file=None, line=None):
        stack = [f for f in traceback.extract_stack()[:-1] if "/h3d/" in f.filename]
        seen["".join(f"  {f.filename.split('/h3d/')[-1]}:{f.lineno} {f.name}\n" for f in stack[-6:])] += 1
    old = warnings.showwarning
    warnings.showwarning = note
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    s, t = first(d + tail()); e.retire(s)
    torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = old
    res["syncs"] = sum(seen.values())
    (out.parent / "turn2prof-syncs.txt").write_text("".join(f"{n} x\n{st}\n" for st, n in seen.most_common()))
# the same right after a new turn 1 (write-behind busy)
d2 = doc(); s, t1 = first(d2, 8); e.retire(s)
with profile(activities=acts) as prof2:
    s, t = first(d2 + tail()); e.retire(s)
res["right_after_2_s"] = t
ka2 = prof2.key_averages()
(out.parent / "turn2prof-right-after.txt").write_text(ka2.table(sort_by="self_cpu_time_total", row_limit=40) + ("\n" + ka2.table(sort_by="self_cuda_time_total", row_limit=25) if cuda else ""))
out.write_text(json.dumps(res, indent=1)); print(json.dumps(res))
