"""Triton's interpreter for the modules that run kernels on the CPU (tests/test_triton_interpreter.py,
tests/test_quant_kernels.py, tests/test_quant_decode_kernels.py, tests/test_sweep_w4.py): its environment, a script
run under it, and whether this machine's interpreter can run the project's kernels at all. The interpreter needs
TRITON_INTERPRET=1 before triton is imported, so each script runs in a subprocess."""
import functools
import json
import os
import subprocess
import sys

import pytest

LOOP_OVER_A_LOADED_BOUND = """
import torch, triton, triton.language as tl
@triton.jit
def k(n_ptr, out_ptr):
    acc = 0
    for i in range(0, tl.load(n_ptr + tl.program_id(0))):
        acc += i
    tl.store(out_ptr, acc)
out = torch.zeros(1, dtype=torch.int32)
k[(1,)](torch.tensor([4], dtype=torch.int32), out)
assert out.item() == 6, out
"""


@functools.lru_cache(maxsize=None)
def interpreter_loops_over_loaded_bounds() -> bool:
    """The kernels loop up to a loaded bound (a row's context, a split's K steps). Triton 3.6's interpreter turns
    such a bound into an index with int() on a one-element array, which NumPy 2.4 refuses; later Triton
    interpreters do not."""
    proc = subprocess.run([sys.executable, "-c", LOOP_OVER_A_LOADED_BOUND], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    # only that failure skips: any other makes the tests run, and fail with their own error
    return "only 0-dimensional arrays can be converted to Python scalars" not in proc.stderr


def skip_unless_the_interpreter_loops():
    if not interpreter_loops_over_loaded_bounds():
        pytest.skip("this Triton's interpreter cannot loop up to a loaded bound with this NumPy (Triton 3.6 with "
                    "NumPy 2.4); on CUDA the kernels are tested by tests/test_triton_kernels.py and "
                    "tests/test_quant_kernels_gpu.py")


def interpreter_env() -> dict:
    """The environment of a script under the interpreter; tests/ is on its path (the scripts import its helpers)."""
    return {**os.environ, "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}


def interpret(script: str):
    """Run script under the interpreter (skipped where it cannot loop); returns the JSON of its last stdout line."""
    skip_unless_the_interpreter_loops()
    proc = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=900,
                          env=interpreter_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
