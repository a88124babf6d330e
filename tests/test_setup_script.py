"""scripts/setup_venv.sh (behind `make demo`, `make test`, `make gpu` and .ci/run): bad settings are refused
before anything is created. The installs themselves run in .ci/run, from a fresh virtual environment."""
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # runs sh and make

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "setup_venv.sh"


def run_script(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    venv = tmp_path / "venv"
    return subprocess.run(["sh", str(SCRIPT), "test"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "VENV": str(venv), **env})


def test_script_parses():
    assert subprocess.run(["sh", "-n", str(SCRIPT)]).returncode == 0


def test_unknown_torch_build_is_refused_before_the_venv_exists(tmp_path):
    proc = run_script(tmp_path, TORCH="rocm")
    assert proc.returncode != 0
    assert "TORCH=rocm is neither cpu nor cuda" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_unsupported_python_is_named(tmp_path):
    proc = run_script(tmp_path, PYTHON="/bin/false")
    assert proc.returncode != 0
    assert "PYTHON=/bin/false is not a Python 3.10-3.14" in proc.stderr
    assert not (tmp_path / "venv").exists()


def test_makefile_targets_call_the_script():
    dry_run = subprocess.run(["make", "-n", "demo", "test", "test-fast", "lint", "gpu", "VENV=/v"], cwd=ROOT,
                             capture_output=True, text=True)
    if dry_run.returncode != 0 and "No such file" in dry_run.stderr:
        import pytest
        pytest.skip("no make here")
    lines = dry_run.stdout.replace("\\\n\t", "").splitlines()  # a recipe's continued lines joined
    assert "sh scripts/setup_venv.sh convert" in lines and "sh scripts/setup_venv.sh test test-triton" in lines
    assert "sh scripts/setup_venv.sh test" in lines  # test-fast and lint: without triton
    assert "/v/bin/nanovllm generate \"What is the capital of France?\"" in lines
    assert any(line.endswith("/v/bin/python -m pytest tests/ -q -n auto") for line in lines)
    fast = [line for line in lines if 'not slow and not subprocess and not gpu and not docs' in line]
    assert len(fast) == 1 and "-m pytest tests/ -q -n auto" in fast[0], lines
    assert "/v/bin/ruff check ." in lines and "/v/bin/vulture" in lines
    assert "/v/bin/python verify_swap.py" in lines
