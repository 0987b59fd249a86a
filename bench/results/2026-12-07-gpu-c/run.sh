#!/bin/bash
# On a GPU host, from the repository root: the phases named in PHASES, each under its limit.
#     PHASES="single prefill-under-load" bash bench/results/2026-12-07-gpu-c/run.sh
# single: 512 steps a row (SINGLE_S); prefill-under-load (PUL_S); many (MANY_S: 16 sessions on
# an H100, 32 on an H200); chat with py-spy (CHAT_S).
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; git log -1 --format=%H; df -h . | tail -1; } >> "$OUT/gpu.txt"
for ph in ${PHASES:-single prefill-under-load}; do
  t0=$(date +%s)
  case $ph in
    single) STEPS=512 LIMIT_S=${SINGLE_S:-280} bash bench/gpu-host.sh single > /dev/null 2>&1 ;;
    prefill-under-load) LIMIT_S=${PUL_S:-280} bash bench/gpu-host.sh prefill-under-load > /dev/null 2>&1 ;;
    many) m=16; echo "$g" | grep -q H200 && m=32
          MANY=$m STEPS=32 LIMIT_S=${MANY_S:-360} bash bench/gpu-host.sh many > /dev/null 2>&1 ;;
    chat) SPY=1 LIMIT_S=${CHAT_S:-190} bash bench/gpu-host.sh chat > /dev/null 2>&1
          gzip -f "$OUT/chat-spy.json" ;;
  esac
  pkill -f "h3d.cli serve"; sleep 1
  echo "$ph: $(( $(date +%s) - t0 )) s" >> "$OUT/gpu.txt"
done
cat "$OUT/gpu.txt"
for f in "$OUT"/*.log; do echo "== $f"; grep -v engine_steps_phases "$f" | grep -v '"gaps_ms"' | tail -8 | cut -c1-1200; done
ls -la "$OUT"
