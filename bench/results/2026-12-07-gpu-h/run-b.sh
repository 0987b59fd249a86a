#!/bin/bash
# On a GPU host, from the repository root: turn2b.py (a chat's second turn: a first use's cost apart
# from write-behind's).
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; } >> "$OUT/gpu.txt"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
t0=$(date +%s)
timeout -s INT "${LIMIT_S:-200}" python3 bench/results/2026-12-07-gpu-h/turn2b.py "$OUT/t" > "$OUT/turn2b.log" 2>&1
echo "turn2b: rc $? $(( $(date +%s) - t0 )) s" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"; grep -v "^\s*$" "$OUT/turn2b.log" | grep -v "Writing model" | tail -14 | cut -c1-700
