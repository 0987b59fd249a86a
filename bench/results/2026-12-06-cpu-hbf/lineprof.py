"""HBF's planning line by line (`pip install line_profiler`): python lineprof.py PICKS DRIFT [SESSIONS],
as `python -m h3d.bench.hbf_cost --shape llama3-8b` plans (160 steps). The figures quoted for the
choice of victims before a25d6c7 come from running it in a checkout of 416ba1a."""
import sys
import numpy as np
from line_profiler import LineProfiler
from h3d.bench import hbf_cost
from h3d.tiers import promotion
lp = LineProfiler()
lp.add_function(promotion.Promoter._promote_seq)
lp.add_function(promotion.Promoter._evict_cold)
lp.add_function(promotion.Promoter.promote)
lp.enable_by_count()
p = hbf_cost.planning(32768, 160, sessions=int(sys.argv[3]) if len(sys.argv) > 3 else 16, shape="llama3-8b", picks_per_head=int(sys.argv[1]), drift=float(sys.argv[2]))
lp.disable_by_count()
lp.print_stats(output_unit=1e-3)
print(np.percentile(p.latencies_us, 50))
