#!/bin/bash
# On an H100, from the repository root, at bf65b09 or later: `many` of 32 sessions of 32K (32
# steps) through the daemon with its defaults, as run.sh ran it at 893604c: now with the
# snapshots counted against the archive's capacity, admission within HBM, DDR and the archive,
# the decode steps bounded by HBM and DDR and the staging fix. One archive back.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; free -g | sed -n 2p; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
TAG=many-32 OUT=$R MANY=32 STEPS=32 LIMIT_S=340 run bash bench/gpu-host.sh many > /dev/null 2>&1
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|tokens/s|refused|appends of|^\|" "$f" | cut -c1-600 | tail -40; done
