#!/bin/bash
# On a GPU host, from the repository root, at 0d11200 (write-behind's holds from a budget), with the
# tree of 822fa3d (before the step's rebalance moved beside the forward) in .old
# (`git archive 822fa3d h3d bench | tar x -C .old`, bench/results left out):
#   a chat's second turn with the defaults, then with write-behind off; then `many` (H100: 16
#   sessions, 32 steps; H200: 32) at this tree, then (H100) at 822fa3d.
# Everything comes back in one archive (all.tgz); the figures are printed.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; git log -1 --format=%H; df -h . | tail -1; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
run() { t0=$(date +%s); "$@"; echo "$TAG: $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
TAG=chat OUT=$R LIMIT_S=100 run bash bench/gpu-host.sh chat > /dev/null 2>&1
TAG=chat-no-write-behind OUT=$R DFLAG=--no-write-behind LIMIT_S=100 run bash bench/gpu-host.sh chat > /dev/null 2>&1
if echo "$g" | grep -q H200; then
  TAG=many-32 OUT=$R MANY=32 STEPS=32 LIMIT_S=330 run bash bench/gpu-host.sh many > /dev/null 2>&1
else
  TAG=many-new OUT=$R MANY=16 STEPS=32 LIMIT_S=175 run bash bench/gpu-host.sh many > /dev/null 2>&1
  ln -sfn ../.bench .old/.bench; ln -sfn ../.whl .old/.whl
  TAG=many-822fa3d OUT=$R MANY=16 STEPS=32 LIMIT_S=175 run bash -c 'cd .old && bash bench/gpu-host.sh many' > /dev/null 2>&1
fi
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|chat: \{|tokens/s|second turn|turn 2" "$f" | cut -c1-700; done
ls -la "$R"
