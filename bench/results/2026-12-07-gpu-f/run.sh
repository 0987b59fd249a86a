#!/bin/bash
# On a GPU host, from the repository root, with little device time left: `many` of 16 sessions
# (32 steps) at this tree, then a chat's second turn with the defaults. The figures are printed.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; git log -1 --format=%H; } >> "$OUT/gpu.txt"
t0=$(date +%s)
MANY=16 STEPS=32 LIMIT_S=190 bash bench/gpu-host.sh many > /dev/null 2>&1
echo "many: $(( $(date +%s) - t0 )) s" >> "$OUT/gpu.txt"; pkill -f "h3d.cli serve"; sleep 1
t0=$(date +%s)
LIMIT_S=90 bash bench/gpu-host.sh chat > /dev/null 2>&1
echo "chat: $(( $(date +%s) - t0 )) s" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"
grep -hE "^\`many\`|engine many|chat: \{" "$OUT"/*.log | cut -c1-1200
ls -la "$OUT"
