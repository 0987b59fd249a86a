#!/bin/bash
# On a GPU host (the H200 the issues name), from the repository root, at 90d857f or later: the
# phases listed in PHASES (default "chat forks"; "many" for 32 sessions of 32K, 32 steps), each
# through the daemon with its defaults. Everything comes back in one archive (all.tgz).
g=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
{ echo "$g"; df -h . | tail -1; } >> "$OUT/gpu.txt"
R=$OUT/r; G=$OUT/gpu.txt; mkdir -p "$R"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
M=.bench/serve/model-llama3-8b-shape
run() { t0=$(date +%s); "$@"; echo "$TAG: rc $? $(( $(date +%s) - t0 )) s" >> "$G"; pkill -f "h3d.cli serve"; sleep 1; tar czf "$OUT/all.tgz" -C "$R" .; }
for ph in ${PHASES:-chat forks}; do
  case $ph in
    chat) TAG=chat OUT=$R LIMIT_S=110 run bash bench/gpu-host.sh chat > /dev/null 2>&1 ;;
    forks) TAG=forks run timeout -s INT 200 python3 -m h3d.bench.prefix --shape llama3-8b --model $M --tokens 32768 \
             --tokenizer .bench/tok --phase forks --out "$R/forks.json" > "$R/forks.log" 2>&1
           (cd .bench/prefix 2>/dev/null && tar czf "$R/forks-logs.tgz" $(find . -name '*.log')) ;;
    many) TAG=many-32 OUT=$R MANY=32 STEPS=32 LIMIT_S=420 run bash bench/gpu-host.sh many > /dev/null 2>&1 ;;
  esac
done
cat "$G"
for f in "$R"/*.log; do echo "== $(basename "$f")"; grep -E "^\`many\`|chat: \{|forks: \{|tokens/s|^\|" "$f" | cut -c1-900 | tail -30; done
