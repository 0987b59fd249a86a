#!/bin/bash
# On a GPU host, from the repository root, at 90d857f or later (slots handed out in order before a
# long append; the segments' merge folded): a chat's second turn with the defaults, then again under
# py-spy (where the daemon's threads are when turn 2 arrives); turn2c.py (the segments against the
# copying path, alternated, with where the prefix lies); turn2.py (turn 2 profiled).
# Everything comes back in one archive (all.tgz); the figures are printed.
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; git log -1 --format=%H 2>/dev/null; df -h . | tail -1; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
TAG=chat OUT=$R LIMIT_S=110 run bash bench/gpu-host.sh chat > /dev/null 2>&1
TAG=chat-spy OUT=$R SPY=1 LIMIT_S=80 run bash bench/gpu-host.sh chat > /dev/null 2>&1
TAG=turn2c run timeout -s INT 110 python3 bench/results/2026-12-07-gpu-i/turn2c.py "$R/c" > "$R/turn2c.log" 2>&1
TAG=turn2 run timeout -s INT 100 python3 bench/results/2026-12-07-gpu-h/turn2.py "$R/t" > "$R/turn2.log" 2>&1
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "chat: \{|^\{'tag|^settled|^right_after" "$f" | cut -c1-900; done
ls -la "$R"
