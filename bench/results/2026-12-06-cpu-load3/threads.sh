#!/bin/bash
# usage: threads.sh TAG [DIR] — the load bench at 64 clients (tiny), with each daemon thread's CPU
# seconds over 20 s of the run (/proc/PID/task/TID/stat). Env: OMP (OMP_NUM_THREADS), SC (a folder
# with a sitecustomize.py, on PYTHONPATH: e.g. `import sys; sys.setswitchinterval(0.0005)`).
tag=$1; out=${2:-/tmp}; cd "$(git rev-parse --show-toplevel)"
OMP_NUM_THREADS=${OMP:-} PYTHONPATH=${SC:-} .venv/bin/python -m h3d.bench.load --model data/models/smollm2-135m-instruct --tiny --clients 64 --requests 20 --max-tokens 16 --json $out/$tag.json > $out/$tag.log 2>&1 &
until grep -q "running 64 x 20" $out/$tag.log; do sleep 0.2; done
pid=$(pgrep -f "h3d.cli serve" | head -1)
snap() { for t in /proc/$pid/task/*; do echo "$(basename $t)-$(cat $t/comm) $(awk '{print $14+$15}' $t/stat)"; done; }
snap > $out/$tag.t0; sleep 20; snap > $out/$tag.t1
wait
python3 - $out/$tag <<'PY'
import sys, collections
base = sys.argv[1]
def rd(f):
    d = collections.Counter()
    for line in open(f):
        n, v = line.rsplit(' ', 1); d[n] += int(v)
    return d
a, b = rd(base + '.t0'), rd(base + '.t1')
for k in sorted(b, key=lambda k: -(b[k] - a.get(k, 0)))[:12]:
    print(f"{(b[k] - a.get(k, 0)) / 100:6.2f} s  {k}")
PY
grep -E "wall per token|engine steps" $out/$tag.log
