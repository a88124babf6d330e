"""Every NANOVLLM_* tuning switch, read once from the environment when nanovllm is imported.

Options that change what the engine computes are Config fields; these only pick between implementations that
compute the same thing, for side-by-side benchmark runs and for tests. Tests change them through the `switches`
fixture (tests/conftest.py), which sets fields of SWITCHES for one test. NANOVLLM_API_KEY belongs to the CLI.
"""
import os
from dataclasses import dataclass, fields


@dataclass
class Switches:
    # NANOVLLM_PREFILL_TILE="block_m,block_n,num_warps,num_stages": the bf16/fp16 prefill attention tile ("": the
    # tuned default); exists so bench.py can run a candidate tile beside the default in one command
    prefill_tile: str = ""
    # NANOVLLM_DECODE_TILE: the same for unsplit decode launches (full batches) at block sizes below 128
    decode_tile: str = ""
    # NANOVLLM_TRITON_SAMPLER (default on): the Triton sampling kernel; off runs the torch sampler, which is also the
    # fallback wherever Triton cannot compile, so tests use it to cover that path
    triton_sampler: bool = True
    # NANOVLLM_DECODE_GRAPHS=1: on CPU, build the decode graphs' static buffers and run them eagerly (CPU tests of
    # the graph code; CUDA captures them whenever enforce_eager is off)
    decode_graphs_on_cpu: bool = False
    # NANOVLLM_PIECEWISE_GRAPHS: "0" turns the piecewise prefill/mixed-step CUDA graphs off; "1" builds them eagerly
    # on CPU (tests); "" (default): captured on CUDA only
    piecewise_graphs: str = ""
    # NANOVLLM_CUDA_STACK (default on): set CUDA's per-thread stack limit to 0 at start-up, which gives the KV cache
    # the driver's stack reservation (memory_profile.py: release_stack_reservation); 0 keeps the driver's default
    release_cuda_stack: bool = True
    # NANOVLLM_CACHE: where converted checkpoints are kept ("": $XDG_CACHE_HOME/nanovllm, else ~/.cache/nanovllm)
    cache_dir: str = ""
    # NANOVLLM_SPLIT_K_REDUCE: how the quantized decode kernels sum their split-K partials: "kernel" (the last
    # program of each output tile, kernels/quant_gemm.py) or "launch" (a second kernel); the same bits either way
    split_k_reduce: str = "kernel"
    # NANOVLLM_FP8_SCALED_MM (default on): per-channel and per-tensor FP8 weights at large M through torch._scaled_mm
    # (cuBLASLt, rowwise scales); 0 runs the Triton W8A8 GEMM (kernels/quant_w8a8.py)
    fp8_scaled_mm: bool = True
    # NANOVLLM_FP8_BLOCK_SCALED_MM (default on): 128 x 128 block FP8 weights at large M through torch._scaled_mm's
    # 1 x 128 / 128 x 128 block scaling (CUDA 12.9+, sm_90); 0 runs the Triton W8A8 GEMM
    fp8_block_scaled_mm: bool = True

    @classmethod
    def from_environ(cls, environ=os.environ) -> "Switches":
        switches = cls()
        for name, field in ENV_NAMES.items():
            value = environ.get(name)
            if value is None:
                continue
            default = getattr(switches, field)
            if isinstance(default, bool):  # "0" turns a default-on switch off, "1" a default-off one on
                value = value != "0" if default else value == "1"
            setattr(switches, field, value)
        return switches


# environment variable -> Switches field
ENV_NAMES = {
    "NANOVLLM_PREFILL_TILE": "prefill_tile",
    "NANOVLLM_DECODE_TILE": "decode_tile",
    "NANOVLLM_TRITON_SAMPLER": "triton_sampler",
    "NANOVLLM_DECODE_GRAPHS": "decode_graphs_on_cpu",
    "NANOVLLM_PIECEWISE_GRAPHS": "piecewise_graphs",
    "NANOVLLM_CUDA_STACK": "release_cuda_stack",
    "NANOVLLM_CACHE": "cache_dir",
    "NANOVLLM_SPLIT_K_REDUCE": "split_k_reduce",
    "NANOVLLM_FP8_SCALED_MM": "fp8_scaled_mm",
    "NANOVLLM_FP8_BLOCK_SCALED_MM": "fp8_block_scaled_mm",
}
assert set(ENV_NAMES.values()) == {f.name for f in fields(Switches)}, "every switch has one environment variable"

SWITCHES = Switches.from_environ()
