#!/bin/bash
# One benchmark phase on a GPU host, through the daemon, as docs/BENCHMARKS.md runs them:
#
#     bash bench/gpu-host.sh PHASE      # many | single | restart | prefill-under-load | chat | ddr100
#
# Run from the repository root. The daemon's packages the host lacks come as wheels in .whl/
# (docs/BENCHMARKS.md, "`h3d serve` on the H200, through gRPC", says which), installed once into
# /tmp/site; the tokenizer's files (tokenizer.json, tokenizer_config.json, chat_template.jinja of
# the embedded model) in $TOK. Results, the phase's log and the daemons' logs (a .tgz) go to $OUT.
#
# Environment: OUT (default bench/results/gpu), TOK (default .bench/tok), LIMIT_S (the phase's
# time limit, default 300), MANY and STEPS (the serve bench's --many and --steps), TRACE=1 (its
# --trace), DFLAG (one --daemon-flag, the chat phase's too: not the defaults, so not the product's figures), TAG (the
# files' name, default the phase), TINY=1 (the serve phases at --tiny: the script's check on a
# CPU), SPY=1 (chat: py-spy, from a wheel in .bench/spy/, samples the
# daemon for the whole phase in speedscope's format, each thread's samples in time order).
set -u
ph=${1:?usage: gpu-host.sh PHASE}; tag=${TAG:-$ph}; lim=${LIMIT_S:-300}
OUT=$(mkdir -p "${OUT:-bench/results/gpu}" && cd "${OUT:-bench/results/gpu}" && pwd)
TOK=${TOK:-.bench/tok}; M=.bench/serve/model-llama3-8b-shape
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
extra=()
[ -n "${MANY:-}" ] && extra+=(--many "$MANY")
[ -n "${STEPS:-}" ] && extra+=(--steps "$STEPS")
[ -n "${TRACE:-}" ] && extra+=(--trace "$OUT/trace-$tag")
[ -n "${DFLAG:-}" ] && extra+=("--daemon-flag=$DFLAG")
[ -n "${TINY:-}" ] && extra+=(--tiny)  # the serve phases' code path on a CPU, in a minute
case $ph in
  many|single|restart|prefill-under-load)
    timeout -s INT "$lim" python3 -m h3d.bench.serve --phase "$ph" --no-hf --tokenizer "$TOK" --out "$OUT/$tag.json" "${extra[@]}" 2>&1 | tee "$OUT/$tag.log"
    (cd .bench/serve && tar czf "$OUT/$tag-logs.tgz" */daemon*.log 2>/dev/null) ;;
  chat)
    [ -d $M ] || python3 -c "
from pathlib import Path; from h3d.bench.serve import Shape, tokenizer_config, write_model
tok = Path('$TOK'); write_model(Path('$M'), Shape.pick(False, tokenizer_config(tok)), tok, 0)"
    timeout -s INT "$lim" python3 -m h3d.bench.prefix --shape llama3-8b --model $M --tokens 32768 --tokenizer "$TOK" --phase chat --out "$OUT/$tag.json" ${DFLAG:+"--daemon-flag=$DFLAG"} 2>&1 | tee "$OUT/$tag.log" &
    if [ -n "${SPY:-}" ]; then
      [ -x /tmp/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/spy .bench/spy/*.whl
      p=""; for _ in $(seq 120); do p=$(pgrep -f "h3d.cli serve" | head -1); [ -n "$p" ] && break; sleep 1; done
      [ -n "$p" ] && /tmp/spy/bin/py-spy record -p "$p" -d $((lim - 10)) -r 200 --idle --threads -f speedscope --nonblocking -o "$OUT/$tag-spy.json" > /dev/null 2>&1 &
    fi
    wait %1
    tar czf "$OUT/$tag-logs.tgz" $(find .bench/prefix -name '*.log') 2>/dev/null ;;
  ddr100)
    d=.bench/ddr100; rm -rf $d; mkdir -p $d
    python3 -m h3d.cli serve --model $M --data-dir $d --ddr-mb 102400 > "$OUT/$tag.log" 2>&1 &
    pid=$!; t0=$(date +%s)
    while kill -0 $pid 2>/dev/null && ! grep -q ddr_pinned "$OUT/$tag.log"; do
      sleep 1; [ $(($(date +%s) - t0)) -gt "$lim" ] && break
    done
    kill -TERM $pid; wait $pid
    grep -E 'ready|ddr_pinned' "$OUT/$tag.log" | cut -c1-600 ;;
  *) echo "gpu-host.sh: unknown phase $ph (many, single, restart, prefill-under-load, chat, ddr100)" >&2; exit 2 ;;
esac
