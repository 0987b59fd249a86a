#!/bin/bash
# On an H200 (32 sessions of 32K hold 137 GB of KV: more than an H100 host's HBM, DDR and disk
# hold, run.sh's H100 run), from the repository root: a chat's second turn at 32K, then `many`
# of 32 sessions of 32K (32 steps), each through the daemon with its defaults. One archive back.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; free -g | sed -n 2p; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
case $g in *H200*) ;; *) echo "not an H200: $g"; exit 3 ;; esac
TAG=chat OUT=$R LIMIT_S=90 run bash bench/gpu-host.sh chat > /dev/null 2>&1
TAG=many-32 OUT=$R MANY=32 STEPS=32 LIMIT_S=260 run bash bench/gpu-host.sh many > /dev/null 2>&1
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|chat: \{|tokens/s|^\|" "$f" | cut -c1-900 | tail -30; done
