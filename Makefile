# One command each: `make demo` (the CPU demo), `make test` (the test suite), `make gpu` (the CUDA build and
# verify_swap.py). Each creates or updates the virtual environment first (scripts/setup_venv.sh).
#   VENV=path       the environment (default .venv)
#   TORCH=cuda      the CUDA build of torch instead of the CPU one (make gpu sets it)
#   PROMPT="..."    the demo's question
VENV ?= .venv
TORCH ?= cpu
PROMPT ?= What is the capital of France?
export VENV TORCH

.PHONY: demo test gpu setup-demo setup-test

demo: setup-demo
	$(VENV)/bin/nanovllm generate "$(PROMPT)"

# the tests run the installed `nanovllm` command too, hence the PATH
test: setup-test
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/python -m pytest tests/ -q

gpu: TORCH = cuda
gpu: setup-demo
	$(VENV)/bin/python verify_swap.py

setup-demo:
	sh scripts/setup_venv.sh convert

setup-test:
	sh scripts/setup_venv.sh test
