#!/bin/bash
# On a GPU host, from the repository root: on an H200 (the card the issues name) a chat's second
# turn at 32K, then `many` of 32 sessions of 32K (32 steps); on an H100 `many` of 32 alone (the
# first 32-session run since d819eb8 kept DDR's copies of the blocks the steps read). Each phase
# through the daemon with its defaults. Everything comes back in one archive (all.tgz).
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; free -g | sed -n 2p; git log --oneline -1 2>/dev/null; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
case $g in *H200*) P="chat many" ;; *) P="many" ;; esac
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
for ph in ${PHASES:-$P}; do
  case $ph in
    chat) TAG=chat OUT=$R LIMIT_S=110 run bash bench/gpu-host.sh chat > /dev/null 2>&1 ;;
    many) TAG=many-32 OUT=$R MANY=32 STEPS=32 LIMIT_S=450 run bash bench/gpu-host.sh many > /dev/null 2>&1 ;;
  esac
done
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|chat: \{|tokens/s|^\|" "$f" | cut -c1-900 | tail -30; done
