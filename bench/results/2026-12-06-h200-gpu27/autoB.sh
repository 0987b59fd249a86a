#!/bin/bash
# Call B. H200: restart, then a start with 100 GiB of DDR. H100: many of 16, then the same start.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
pkill -f "h3d.cli serve"; rm -rf .bench/serve/many .bench/chat
df -h . | tail -1; free -g | head -2
if echo "$gpu" | grep -q H200; then
  LIMIT_S=330 bash .bench/gpu.sh restart 2>&1 | tail -6
  cp .bench/serve/restart/*.log $OUT/ 2>/dev/null
else
  MANY=16 TRACE=1 LIMIT_S=260 bash .bench/gpu.sh many 2>&1 | grep -v "^\[serve-bench.*many: {" | tail -4
fi
pkill -f "h3d.cli serve"; rm -rf .bench/serve/many
LIMIT_S=150 bash .bench/gpu.sh ddr100 2>&1 | tail -8
rm -f $OUT/*-logs.tgz
