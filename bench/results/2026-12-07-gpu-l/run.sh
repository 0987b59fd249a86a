#!/bin/bash
# On a GPU host, from the repository root, at 1af21fa or later (the probe's splits combined in one
# kernel, a short chunk's digests by scatter): a chat's second turn with the defaults, twice;
# turn2.py (turn 2 profiled); `many` of 16 sessions, 32 steps. Everything comes back in one
# archive (all.tgz); the figures are printed.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
TAG=chat OUT=$R LIMIT_S=110 run bash bench/gpu-host.sh chat > /dev/null 2>&1
TAG=chat-2 OUT=$R LIMIT_S=80 run bash bench/gpu-host.sh chat > /dev/null 2>&1
TAG=turn2 run timeout -s INT 100 python3 bench/results/2026-12-07-gpu-h/turn2.py "$R/t" > "$R/turn2.log" 2>&1
TAG=many-16 OUT=$R MANY=16 STEPS=32 LIMIT_S=175 run bash bench/gpu-host.sh many > /dev/null 2>&1
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|chat: \{|^settled|^right_after|tokens/s" "$f" | cut -c1-700; done
