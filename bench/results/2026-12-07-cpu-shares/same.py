"""The fair shares' rebalance of `../2026-12-07-cpu-rebalance/rebal.py` (same arguments), then the
HBM state every session's table ends with, as one digest, and the blocks moved: the same in two
trees means the same moves (`PYTHONPATH=TREE python same.py 12 8192 0.4` in each)."""

import hashlib
import runpy
from pathlib import Path

run = runpy.run_path(str(Path(__file__).parent.parent / "2026-12-07-cpu-rebalance" / "rebal.py"), run_name="rebal")
kv, seqs, moved = run["kv"], run["seqs"], run["moved"]
h = hashlib.sha1()
for s in seqs:
    t = kv.blocks.table(s)
    h.update((kv.blocks.entries.hbm[t.ids[:, : t.num_blocks]] != -1).tobytes())
print("state", h.hexdigest(), "moved", sum(moved))
