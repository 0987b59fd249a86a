#!/bin/bash
# One benchmark phase on the GPU host: gpu.sh PHASE (many | chat | restart | ddr100 | single)
# env: LIMIT_S (timeout), MANY, STEPS, TRACE=1, DFLAG (one daemon flag), TAG (file name suffix)
ph=$1; tag=${TAG:-$ph}; lim=${LIMIT_S:-300}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
TOK=.bench/tok; M=.bench/serve/model-llama3-8b-shape
extra=()
[ -n "${MANY:-}" ] && extra+=(--many "$MANY")
[ -n "${STEPS:-}" ] && extra+=(--steps "$STEPS")
[ -n "${TRACE:-}" ] && extra+=(--trace "$OUT/trace-$tag")
[ -n "${DFLAG:-}" ] && extra+=("--daemon-flag=$DFLAG")
case $ph in
  many|single|restart|prefill-under-load)
    timeout -s INT $lim python3 -m h3d.bench.serve --phase $ph --no-hf --tokenizer $TOK --out $OUT/$tag.json "${extra[@]}" 2>&1 | tee $OUT/$tag.log
    (cd .bench/serve && tar czf $OUT/$tag-logs.tgz */daemon*.log 2>/dev/null) ;;
  chat)
    [ -d $M ] || python3 -c "
from pathlib import Path; from h3d.bench.serve import Shape, tokenizer_config, write_model
tok = Path('$TOK'); write_model(Path('$M'), Shape.pick(False, tokenizer_config(tok)), tok, 0)"
    timeout -s INT $lim python3 -m h3d.bench.prefix --shape llama3-8b --model $M --tokens 32768 --tokenizer $TOK --phase chat --out $OUT/$tag.json 2>&1 | tee $OUT/$tag.log &
    if [ -n "${SPY:-}" ]; then  # py-spy on the daemon for the whole phase (the turns' host time)
      [ -x /tmp/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /tmp/spy .bench/spy/*.whl
      for i in $(seq 120); do p=$(pgrep -f "h3d.cli serve" | head -1); [ -n "$p" ] && break; sleep 1; done
      [ -n "$p" ] && /tmp/spy/bin/py-spy record -p $p -d $((lim-10)) -r 200 --idle --threads -f raw --nonblocking -o $OUT/$tag-spy.raw > /dev/null 2>&1 &
    fi
    wait %1
    tar czf $OUT/$tag-logs.tgz $(find .bench/prefix -name '*.log') 2>/dev/null ;;
  ddr100)
    d=.bench/ddr100; rm -rf $d; mkdir -p $d
    python3 -m h3d.cli serve --model $M --data-dir $d --ddr-mb 102400 > $OUT/$tag.log 2>&1 &
    pid=$!; t0=$(date +%s)
    while kill -0 $pid 2>/dev/null && ! grep -q ddr_pinned $OUT/$tag.log; do sleep 1; [ $(( $(date +%s) - t0 )) -gt $lim ] && break; done
    kill -TERM $pid; wait $pid
    grep -E 'ready|ddr_pinned' $OUT/$tag.log | cut -c1-600 ;;
  *) echo "unknown phase $ph"; exit 2 ;;
esac
