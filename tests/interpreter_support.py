"""Whether this machine's Triton interpreter can run the project's kernels, for the modules that run them on the
CPU (tests/test_triton_interpreter.py, tests/test_quant_kernels.py and those that use its `interpret`)."""
import functools
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
