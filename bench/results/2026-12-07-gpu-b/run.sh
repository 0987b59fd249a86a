#!/bin/bash
# On a GPU host, from the repository root: `many` (16 sessions of 32K on an H100, 32 on an H200;
# 32 steps), then, where time is left (PHASES), a chat's second turn with py-spy on the daemon.
#     PHASES="many chat" bash bench/results/2026-12-07-gpu-b/run.sh
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; git log -1 --format=%H; df -h . | tail -1; } >> "$OUT/gpu.txt"
for ph in ${PHASES:-many chat}; do
  t0=$(date +%s)
  case $ph in
    many) m=16; echo "$g" | grep -q H200 && m=32
          MANY=$m STEPS=32 LIMIT_S=${MANY_S:-360} bash bench/gpu-host.sh many > /dev/null 2>&1 ;;
    chat) SPY=1 LIMIT_S=${CHAT_S:-190} bash bench/gpu-host.sh chat > /dev/null 2>&1
          gzip -f "$OUT/chat-spy.json" ;;
  esac
  echo "$ph: $(( $(date +%s) - t0 )) s" >> "$OUT/gpu.txt"
done
cat "$OUT/gpu.txt"
[ -f "$OUT/many.log" ] && grep -v engine_steps_phases "$OUT/many.log" | tail -4 | cut -c1-1500
[ -f "$OUT/chat.log" ] && tail -12 "$OUT/chat.log"
ls -la "$OUT"
