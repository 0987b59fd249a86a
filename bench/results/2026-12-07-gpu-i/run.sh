#!/bin/bash
# On a GPU host, from the repository root, at 8b3d370 or later (a chunk over cached keys attends to
# them in place): whether the segments agree on this device; a chat's second turn with the defaults
# (the daemon's `warmed` event says which path it serves); turn2b.py (a first use's cost apart from
# write-behind's); turn2.py (turn 2 profiled). On an H200, `many` at 32 sessions first.
# Everything comes back in one archive (all.tgz); the figures are printed.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -c "
import torch; from h3d.kv.attention import segments_agree
print('segments_agree bf16 32/8/128:', segments_agree(torch.device('cuda'), torch.bfloat16, 32, 8, 128))" >> "$G" 2>&1
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
if echo "$g" | grep -q H200; then
  TAG=many-32 OUT=$R MANY=32 STEPS=32 LIMIT_S=330 run bash bench/gpu-host.sh many > /dev/null 2>&1
fi
TAG=chat OUT=$R LIMIT_S=110 run bash bench/gpu-host.sh chat > /dev/null 2>&1
(cd "$R" && tar xzf chat-logs.tgz 2>/dev/null; grep -rh '"warmed"' . | head -2 | cut -c1-600) >> "$G"
TAG=turn2b run timeout -s INT 150 python3 bench/results/2026-12-07-gpu-h/turn2b.py "$R/b" > "$R/turn2b.log" 2>&1
if ! echo "$g" | grep -q H200; then
  TAG=turn2 run timeout -s INT 120 python3 bench/results/2026-12-07-gpu-h/turn2.py "$R/t" > "$R/turn2.log" 2>&1
fi
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|chat: \{|tokens/s|second turn|turn 2|^settled|^right_after|^\{" "$f" | cut -c1-900; done
ls -la "$R"
