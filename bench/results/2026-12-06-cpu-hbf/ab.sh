#!/bin/bash
# hbf_cost at 416ba1a (lexsort victims) and a25d6c7 (packed keys), one after the other per config
cd AFTER
for a in "--sessions 16" "--sessions 16 --picks 186 --drift 0.5" "--sessions 32" "--sessions 32 --picks 186 --drift 0.5"; do
  for tree in BEFORE AFTER; do
    echo "== $tree: python -m h3d.bench.hbf_cost --shape llama3-8b --steps 300 $a"
    (cd $tree && PYTHONPATH=$tree AFTER/.venv/bin/python -m h3d.bench.hbf_cost --shape llama3-8b --steps 300 $a 2>&1 | tail -6)
  done
done
