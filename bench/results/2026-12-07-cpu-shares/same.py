"""(same.py: rebal.py, then a digest of the end state.) The fair shares' rebalance at the H100 many's scale, in process on the CPU host: SESSIONS sessions
of TOKENS tokens (32 layers; blocks of h3d.bench.hbf_cost's BS tokens, one element wide), appended
one after another into an HBM of PART of their blocks, then the rebalance calls an upkeep makes
(`KVCache.rebalance` of every session, the default rebalance_mb_per_step over the Llama-3-8B
shape's bf16 blocks), each timed, until one moves nothing.

    python rebal.py SESSIONS TOKENS PART      # e.g. 16 32768 0.5
"""
import sys, time
import numpy as np, torch
from h3d.config import EngineConfig
from h3d.hbf.policy import policy_named
from h3d.kv.blocks import SeqId
from h3d.kv.cache import KVCache
from h3d.bench.hbf_cost import BS

sessions, tokens, part = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
layers = 32
nb = tokens // BS
hbm = int(nb * sessions * part)
kv = KVCache(num_layers=layers, num_kv_heads=1, head_dim=1, dtype=torch.float32, device=torch.device("cpu"),
             hbm_regions=hbm, ddr_slots=nb * layers * sessions, block_size=BS, hbf=EngineConfig().hbf)
block_bytes = BS * 8 * 128 * 2 * 2
kv.rebalance_blocks = int(EngineConfig().rebalance_mb_per_step * 2**20) // block_bytes
seqs = [SeqId(1 + i) for i in range(sessions)]
for seq in seqs:
    kv.open(seq, "bench", policy_named("attention_entropy"))
    for start in range(0, tokens, 4096):  # one after another, as `many` appends them
        kv.blocks.append(seq, min(4096, tokens - start))
print("budget", kv.rebalance_blocks, "hbm/layer", hbm, "held by the first four", [int(kv.shares.held(s).sum()) for s in seqs[:4]])
times, moved = [], []
for step in range(40):
    t0 = time.perf_counter()
    m = kv.rebalance(seqs)
    times.append((time.perf_counter() - t0) * 1e3); moved.append(m)
    if m == 0 and step > 2:
        break
print("steps", len(times), "ms", [round(x, 1) for x in times])
print("moved", moved)
# The HBM state every session's table ends with, as one digest, and the blocks moved: the same in
# two trees means the same moves (python same.py 12 8192 0.4 in each).
import hashlib

h = hashlib.sha1()
for s in seqs:
    t = kv.blocks.table(s)
    h.update((kv.blocks.entries.hbm[t.ids[:, : t.num_blocks]] != -1).tobytes())
print("state", h.hexdigest(), "moved", sum(moved))
