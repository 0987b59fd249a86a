#!/bin/bash
# On an H100, from the repository root: `many` of 20 sessions of 32K (32 steps) through the daemon
# with its defaults: 86 GB of KV against the host's 102 GB of HBM and DDR (the share that 32
# sessions hold of an H200 host's), more than HBM alone holds. One archive back.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; free -g | sed -n 2p; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
TAG=many-20 OUT=$R MANY=20 STEPS=32 LIMIT_S=520 run bash bench/gpu-host.sh many > /dev/null 2>&1
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|tokens/s|^\|" "$f" | cut -c1-900 | tail -30; done
