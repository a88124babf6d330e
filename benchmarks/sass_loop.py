"""The 4-bit decode kernel's main loop counted in SASS, on a machine without a GPU: how many instructions a thread
issues per 4-bit weight value it unpacks.

At one or two rows the kernel (quant_gemv._int4_gemv_kernel) issues instructions faster than the weights arrive
only if each value costs few of them: an H100 SM issues 4 warp instructions a clock (128 thread instructions), so at
5 instructions a value its 132 SMs unpack ~6e12 values a second at 1.75 GHz, about the 3 TB/s of copy bandwidth in
4-bit weights, and any stall puts the kernel below it. The count is the lever a CPU can measure; the GPU measures
the bandwidth (bench_quant_kernels.py).

The kernel is compiled through the compile tests' stand-in driver (tests/triton_standin.py: a launch becomes a
compile for sm_<cc>), its cubin disassembled with the nvdisasm that Triton ships, and the instructions of its
longest loop (one K step) counted by opcode and divided by the values a thread unpacks a step
(BLOCK_N x BLOCK_K / threads). The loop also loads the next step's words and the step's scales.

    python benchmarks/sass_loop.py                 # 1 and 2 rows, sm_90, the plan's tiles for a 4096 x 4096 layer
    python benchmarks/sass_loop.py --rows 1 --cc 89 --n 24576
    python benchmarks/sass_loop.py --kind int8-head --n 151936   # the 8-bit CUDA-core kernel (_byte_gemv_kernel)

Counts depend on Triton's version (its lowering and ptxas): compare them within one version.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_LABEL = re.compile(r"\s*\.(L_x_\d+):")
_BACK_BRANCH = re.compile(r"BRA `\(\.(L_x_\d+)\)")
_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcode -> count over the longest loop of nvdisasm's output: from a label to the last branch back to it."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := _BACK_BRANCH.search(line)) and labels.get(m.group(1), len(lines)) < i]
    if not loops:
        raise ValueError("no loop in the SASS: no branch goes back to a label before it")
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return collections.Counter(m.group(1) for line in lines[first:last + 1] if (m := _INSTRUCTION.match(line)))


_compiled: list = []  # the kernels compiled since the stand-in driver was installed, in order


def _compile_launches(cc: int) -> list:
    """Installs, once a process, the compile tests' stand-in driver for sm_<cc> (a launch becomes a compile; no
    shared-memory check here: the compile tests make it); returns the list each compiled kernel is appended to."""
    if not _compiled:
        sys.path.insert(0, str(ROOT / "tests"))  # the stand-in driver is the compile tests' own
        from triton.runtime.jit import JITFunction
        from triton_standin import compile_instead_of_launching
        compile_instead_of_launching(cc, 1 << 30)
        compile_only = JITFunction.run

        def keep(self, *args, **kwargs):
            _compiled.append(compile_only(self, *args, **kwargs))
            return _compiled[-1]
        JITFunction.run = keep
        _compiled.append(None)  # installed: later calls add nothing
    return _compiled


def compile_w4_decode(rows: int, n: int, k: int, cc: int, group_k: int = 128, tiles=None):
    """The compiled kernel that quant_matmul.weight_only_linear launches for `rows` rows of 4-bit weights [n, k],
    and its plan: the engine's (W4_DECODE_TILES), or that of `tiles` (a quant_plans.DecodeTiles)."""
    import torch
    compiled = _compile_launches(cc)
    from nanovllm.kernels import quant_gemm, quant_plans
    from nanovllm.kernels import quant_matmul as qm
    plan = (quant_plans.plan_weight_only(rows, n, k, group_k, weight_kind=quant_gemm.KIND_INT4) if tiles is None
            else quant_plans.plan_w4_decode(rows, n, k, group_k, tiles))
    qweight = torch.zeros(n, k // 8, dtype=torch.int32)
    scales, mins = torch.ones(n, k // group_k, dtype=torch.float16), torch.zeros(n, k // group_k)
    qm.weight_only_linear(torch.zeros(rows, k, dtype=torch.bfloat16), qweight, scales, mins, quant_gemm.KIND_INT4, 1,
                          group_k, plan)
    return compiled[-1], plan


def compile_byte_decode(n: int, k: int, cc: int, kind: str):
    """The compiled kernel and plan for one row of 8-bit weights [n, k] without mins: "int8-head" (a scale per row,
    --quantize-lm-head int8's layout) or "fp8-block" (128 x 128 blocks, Qwen's FP8 checkpoints)."""
    import torch
    compiled = _compile_launches(cc)
    from nanovllm.kernels import quant_gemm
    from nanovllm.kernels import quant_matmul as qm
    if kind == "int8-head":
        weight_kind, qweight, scales, group_n, group_k = (quant_gemm.KIND_INT8, torch.zeros(n, k, dtype=torch.int8),
                                                          torch.ones(n, 1), 1, k)
    else:
        weight_kind, qweight, scales, group_n, group_k = (quant_gemm.KIND_FP8,
                                                          torch.zeros(n, k, dtype=torch.float8_e4m3fn),
                                                          torch.ones(-(-n // 128), k // 128), 128, 128)
    plan = qm.plan_weight_only(1, n, k, group_k, weight_kind=weight_kind, group_n=group_n)
    qm.weight_only_linear(torch.zeros(1, k, dtype=torch.bfloat16), qweight, scales, None, weight_kind, group_n,
                          group_k, plan)
    return compiled[-1], plan


def disassemble(cubin: bytes) -> str:
    import tempfile

    import triton
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], check=True, capture_output=True, text=True).stdout


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2], help="rows (M) of the layer's input")
    parser.add_argument("--cc", type=int, default=90, help="compute capability: 90 (H100/H200), 89 (RTX 40)")
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--tiles", nargs=3, metavar=("KERNEL", "BLOCK_N", "NUM_WARPS"), default=None,
                        help="count another W4_DECODE_TILES entry than the engine's, e.g. gemv 256 4")
    parser.add_argument("--kind", default="w4", choices=["w4", "int8-head", "fp8-block"],
                        help="4-bit weights (groups of 128), or 8-bit ones at one row (the int8 LM head's layout, "
                             "or FP8 in 128 x 128 blocks)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    import triton
    print(f"triton {triton.__version__}, sm_{args.cc}, a {args.n} x {args.k} layer, {args.kind}")
    from nanovllm.kernels.quant_plans import DecodeTiles
    for rows in ([1] if args.kind != "w4" else args.rows):
        if args.kind != "w4":
            kernel, plan = compile_byte_decode(args.n, args.k, args.cc, args.kind)
        else:
            tiles = None
            if args.tiles:
                kernel_name, block_n, num_warps = args.tiles[0], int(args.tiles[1]), int(args.tiles[2])
                tiles = DecodeTiles(max(rows, 2), kernel_name, block_n, 128, num_warps, 4)
            kernel, plan = compile_w4_decode(rows, args.n, args.k, args.cc, tiles=tiles)
        print_count(rows, kernel, plan)


def print_count(rows: int, kernel, plan):
    ops = loop_opcodes(disassemble(kernel.asm["cubin"]))
    values_per_thread = plan.block_n * plan.block_k // (32 * plan.num_warps)
    total = sum(ops.values())
    top = ", ".join(f"{op} {count}" for op, count in ops.most_common(8))
    print(f"{rows} row(s): {kernel.name}, {plan.block_n} x {plan.block_k} tiles, {plan.num_warps} warps: "
          f"{total} instructions a K step, {total / values_per_thread:.2f} per value a thread "
          f"({total / values_per_thread / rows:.2f} per value and row); {top}")


if __name__ == "__main__":
    main()
