# One command each: `make demo` (the CPU demo), `make serve` (the OpenAI-compatible server on 127.0.0.1:8000),
# `make test` (the whole test suite), `make test-fast` (its fast core, without triton), `make lint` (ruff and
# vulture), `make gpu` (the CUDA build and verify_swap.py). Each creates or updates the virtual environment first
# (scripts/setup_venv.sh).
#   VENV=path       the environment (default .venv)
#   TORCH=cuda      the CUDA build of torch instead of the CPU one (make gpu sets it)
#   PROMPT="..."    the demo's question
#   SERVE_ARGS="..." `nanovllm serve`'s arguments (e.g. "--port 8001"; default: SmolLM2 on port 8000)
#   WORKERS=n       pytest-xdist workers (default auto: one per core, each with one intra-op thread)
VENV ?= .venv
TORCH ?= cpu
PROMPT ?= What is the capital of France?
SERVE_ARGS ?=
WORKERS ?= auto
export VENV TORCH

.PHONY: demo serve test test-fast lint gpu setup-demo setup-serve setup-test setup-test-fast

demo: setup-demo
	$(VENV)/bin/nanovllm generate "$(PROMPT)"

serve: setup-serve
	$(VENV)/bin/nanovllm serve $(SERVE_ARGS)

# the tests run the installed `nanovllm` command too, hence the PATH
test: setup-test
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/python -m pytest tests/ -q -n $(WORKERS)

# the core: no test marked slow, subprocess, gpu or docs (pyproject.toml's markers)
test-fast: setup-test-fast
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/python -m pytest tests/ -q -n $(WORKERS) \
		-m "not slow and not subprocess and not gpu and not docs"

lint: setup-test-fast
	$(VENV)/bin/ruff check .
	$(VENV)/bin/vulture

gpu: TORCH = cuda
gpu: setup-demo
	$(VENV)/bin/python verify_swap.py

setup-demo:
	sh scripts/setup_venv.sh convert

setup-serve:
	sh scripts/setup_venv.sh convert serve

setup-test:
	sh scripts/setup_venv.sh test test-triton

setup-test-fast:
	sh scripts/setup_venv.sh test
