#!/bin/bash
# Call A. H200: many at 32 x 32K, then a chat's second turn. H100: chat, then restart.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
if echo "$gpu" | grep -q H200; then bash .bench/h200a.sh; exit; fi
df -h . | tail -1
LIMIT_S=200 bash .bench/gpu.sh chat 2>&1 | tail -4
pkill -f "h3d.cli serve"; rm -rf .bench/chat
LIMIT_S=330 bash .bench/gpu.sh restart 2>&1 | tail -6
cp .bench/serve/restart/*.log $OUT/ 2>/dev/null; rm -f $OUT/*-logs.tgz
