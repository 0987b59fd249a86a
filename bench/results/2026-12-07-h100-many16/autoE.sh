#!/bin/bash
# many at 32 x 32K (H200; 16 on an H100), 32 steps, the daemon's log kept.
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
df -h . | tail -1; free -g | head -2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
echo "$gpu" | grep -q H200 || export MANY=16
t0=$(date +%s)
STEPS=32 LIMIT_S=${LIMIT_S:-400} bash .bench/gpu.sh many 2>&1 | grep -v "^\[serve-bench.*many: {" | tail -12
echo "many took $(( $(date +%s) - t0 )) s"
ls -la $OUT
