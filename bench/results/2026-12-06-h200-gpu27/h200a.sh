#!/bin/bash
# H200: many at the phase's default (32 x 32K), then a chat's second turn.
df -h . /tmp | tail -2; free -g | head -2
LIMIT_S=330 TRACE=1 bash .bench/gpu.sh many 2>&1 | grep -v "^\[serve-bench.*many: {" | tail -5
pkill -f "h3d.cli serve" ; sleep 2; rm -rf .bench/serve/many
[ -e .bench/model-llama3-8b-shape ] || ln -s serve/model-llama3-8b-shape .bench/model-llama3-8b-shape
LIMIT_S=200 bash .bench/gpu.sh chat 2>&1 | tail -4
rm -f $OUT/*-logs.tgz
