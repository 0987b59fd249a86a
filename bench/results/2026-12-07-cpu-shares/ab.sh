#!/bin/bash
# rebal.py (the fair shares' rebalance at the H100 many's scale) in two trees, one after the
# other, twice: BEFORE and AFTER are checkouts (e.g. `git worktree add --detach DIR db95e86`).
#     bash ab.sh BEFORE AFTER
for i in 1 2; do for t in "$1" "$2"; do
  echo "$t"; PYTHONPATH=$t python "$(dirname "$0")/../2026-12-07-cpu-rebalance/rebal.py" 16 32768 0.5 | sed -n 2p | python -c "
import re, statistics, sys
xs = [float(x) for x in re.findall(r'[\d.]+', sys.stdin.read().split('[')[1].split(']')[0])]
mid = xs[1:-1]
print('calls', len(xs), 'first %.1f' % xs[0], 'the moving calls: median %.2f, min %.1f, max %.1f' % (statistics.median(mid), min(mid), max(mid)))"
done; done
