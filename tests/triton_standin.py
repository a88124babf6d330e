"""Kernel launches turned into compiles for a GPU this machine does not have: a stand-in for Triton's CUDA driver
that names the target, and a JITFunction.run that compiles, checks the compile's shared memory against the target's
limit, and launches nothing. Shared by tests/test_triton_compile.py and tests/test_quant_kernels_compile.py, whose
scripts call compile_instead_of_launching in a subprocess of their own (run_compile_script): the driver is
process-wide. Imports triton only when called, so a machine without it can still collect those tests (they skip)."""
import subprocess
import sys
from pathlib import Path

import torch

TESTS_DIR = Path(__file__).resolve().parent


class StandInDriver:
    """Enough of Triton's CUDA driver for a compile: device 0, stream 0, target sm_<target_cc>."""

    def __init__(self, target_cc: int):
        self.target_cc = target_cc

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.target_cc, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_instead_of_launching(target_cc: int, shared_limit_bytes: int) -> set[str]:
    """From now on in this process every Triton kernel launch compiles for sm_<target_cc> (asserting it produced a
    cubin and needs at most shared_limit_bytes of shared memory a block) and launches nothing. Returns the set that
    each compiled kernel's name is added to."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled = set()
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        assert kernel is not None and kernel.asm.get("cubin"), self.fn.__name__
        shared = kernel.metadata.shared
        assert shared <= shared_limit_bytes, (f"{self.fn.__name__} needs {shared} bytes of shared memory on "
                                              f"sm_{target_cc}, over {shared_limit_bytes}: {kwargs}")
        compiled.add(self.fn.__name__)
        return kernel

    JITFunction.run = compile_only
    driver.set_active(StandInDriver(target_cc))
    return compiled


def run_compile_script(script: str, args: list, timeout_s: int) -> subprocess.CompletedProcess:
    """`script` in a fresh Python (sys.argv[1:] = args) that can import this module."""
    prelude = f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + script, *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=timeout_s)
