#!/bin/bash
# A chat's second turn at 32K (right after the first, and once write-behind settled).
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $gpu"
[ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
M=.bench/model-llama3-8b-shape
PYTHONPATH=/tmp/site:$PWD python3 -c "
from pathlib import Path; from h3d.bench.serve import Shape, tokenizer_config, write_model
tok = Path('.bench/tok'); write_model(Path('$M'), Shape.pick(False, tokenizer_config(tok)), tok, 0)"
LIMIT_S=240 bash .bench/gpu.sh chat 2>&1 | tail -4
rm -f $OUT/*-logs.tgz
