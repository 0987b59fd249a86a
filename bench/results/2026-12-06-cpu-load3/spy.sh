#!/bin/bash
# usage: spy.sh TAG [DIR] — the load bench at 64 clients (tiny) with py-spy (raw, idle, threads) on
# the daemon for 15 s of the run.
tag=$1; out=${2:-/tmp}; cd "$(git rev-parse --show-toplevel)"
.venv/bin/python -m h3d.bench.load --model data/models/smollm2-135m-instruct --tiny --clients 64 --requests 20 --max-tokens 16 --json $out/$tag.json > $out/$tag.log 2>&1 &
until grep -q "running 64 x 20" $out/$tag.log; do sleep 0.5; done
pid=$(pgrep -f "h3d.cli serve" | head -1)
sleep 2
.venv/bin/py-spy record -p $pid -d 15 -r 200 --idle --threads -f raw -o $out/$tag.raw > /dev/null 2>&1
wait
