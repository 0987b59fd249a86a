#!/bin/bash
# On a GPU host, from the repository root: turn2.py (a chat's second turn in process, profiled).
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; } >> "$OUT/gpu.txt"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
t0=$(date +%s)
timeout -s INT "${LIMIT_S:-400}" python3 bench/results/2026-12-07-gpu-h/turn2.py "$OUT/t" > "$OUT/turn2.log" 2>&1
echo "turn2: rc $? $(( $(date +%s) - t0 )) s" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"; grep -v "^\s*$" "$OUT/turn2.log" | tail -30 | cut -c1-1500
cd "$OUT/t" && tar czf "$OUT/t.tgz" . && ls -la "$OUT/t"
