"""`verify_swap.py MODEL` on a CPU-only machine: the CPU checks run (each in its own process, forked from a
forkserver that imported the engine once) and pass; the CUDA-only ones say SKIP."""
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # verify_swap.py's checks, each in its own process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_verify_swap_on_cpu(qwen3_dir):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "verify_swap.py"), qwen3_dir], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    for check in ("resume_mid_decode", "heavy_swap", "counters", "fp8_resume_mid_decode"):
        assert any(line.startswith(f"PASS {check}") for line in lines), proc.stdout
    for check in ("kv_roundtrip", "bandwidth", "tp2", "fp8_kv_roundtrip"):
        assert any(line.startswith(f"SKIP {check}") for line in lines), proc.stdout
