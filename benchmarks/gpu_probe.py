"""A quick GPU probe (< 60 s) for the quantized linear paths: which torch._scaled_mm scaling modes this torch and
CUDA run on this GPU, how fast each is on one Qwen3-8B shape against bf16 cuBLAS, how fast the FP8 activation
quantization is, and one timing per decode kernel with its register and spill counts.

    python benchmarks/gpu_probe.py [--shape gate_up] [--m 1024]

Every section catches its own failure and prints it, so that one missing mode does not hide the others.
Timing and the L2-defeating weight copies are bench_quant_kernels.py's (CUDA graphs, median of 5 replays).
"""
import argparse
import math
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_quant_kernels as bqk  # noqa: E402

from nanovllm.kernels import quant_gemm, quant_gemv  # noqa: E402
from nanovllm.kernels import quant_w8a8  # noqa: E402


def section(title: str):
    """Decorator: run the function, print its title first and any exception instead of stopping."""
    def wrap(fn):
        def run(*args, **kwargs):
            print(f"== {title}", flush=True)
            try:
                fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 -- a probe reports and goes on
                print(f"   FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
                traceback.print_exc(limit=3, file=sys.stdout)
        return run
    return wrap


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def timed(fn, num_calls: int) -> float:
    return bqk.graph_us(lambda i: fn(i), num_calls)


@section("environment")
def environment():
    props = torch.cuda.get_device_properties(0)
    import triton
    print(f"   {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
          f"{props.total_memory / 2**30:.1f} GiB; torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"triton {triton.__version__}")
    scaling_types = [n for n in dir(getattr(F, "ScalingType", None)) if n[0].isupper()]
    print(f"   torch.nn.functional.scaled_mm (v2 API): {hasattr(F, 'scaled_mm')}, ScalingType: {scaling_types}")


def _fp8_operands(M: int, N: int, K: int, num_copies: int):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    ws = [(torch.randn(N, K, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
          for _ in range(num_copies)]
    return x, ws


@section("torch._scaled_mm modes (e4m3 x e4m3 -> bf16), correctness against fp32 and time against bf16 cuBLAS")
def scaled_mm_modes(N: int, K: int, ms: list):
    num_copies = max(2, math.ceil(bqk.L2_DEFEAT_BYTES / (N * K)))
    for M in ms:
        x, ws = _fp8_operands(M, N, K, num_copies)
        w16 = [w.to(torch.bfloat16) for w in ws[:2]]
        bf16_us = timed(lambda i: F.linear(x, w16[i % 2]), 2)
        xq = x.clamp(-448, 448).to(torch.float8_e4m3fn)
        ref = xq.float() @ ws[0].float().T
        w_blk = torch.rand(N // 128, K // 128, device="cuda") + 0.5  # [N / 128, K / 128], the checkpoint layout
        x_blk_cm = (torch.rand(K // 128, M, device="cuda") + 0.5).t()  # [M, K / 128], stride (1, M)
        w_row_blk = w_blk.repeat_interleave(128, 0)  # [N, K / 128]: each row its block's scales
        modes = {
            "tensorwise": (torch.tensor(1.0, device="cuda"), torch.tensor(1.0, device="cuda"), None),
            "rowwise": (torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda"), None),
            "rowwise fast_accum": (torch.ones(M, 1, device="cuda"), torch.ones(1, N, device="cuda"), "fast"),
            "block 1x128 x 128x128": (x_blk_cm, w_blk.t(), "blk"),
            "block 1x128 x 1x128": (x_blk_cm, w_row_blk.t().contiguous().t(), "row_blk"),
        }
        print(f"   M={M} N={N} K={K}: bf16 cuBLAS {bf16_us:.1f} us ({2 * M * N * K / bf16_us / 1e6:.0f} TFLOP/s)")
        for name, (sa, sb, kind) in modes.items():
            try:
                fast = kind == "fast"
                y = torch._scaled_mm(xq, ws[0].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                     use_fast_accum=fast)
                if kind in ("blk", "row_blk"):
                    xs_full = sa.repeat_interleave(128, 1)  # [M, K]
                    w_rows = w_blk.repeat_interleave(128, 0) if kind == "blk" else w_row_blk  # [N, K / 128]
                    ws_full = w_rows.repeat_interleave(128, 1)
                    r = (xq.float() * xs_full) @ (ws[0].float() * ws_full).T
                else:
                    r = ref
                err = rel_err(y, r)
                us = timed(lambda i, sa=sa, sb=sb, fast=fast: torch._scaled_mm(
                    xq, ws[i % num_copies].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                    use_fast_accum=fast), num_copies)
                print(f"     {name:<24} {us:8.1f} us {bf16_us / us:5.2f}x bf16 {2 * M * N * K / us / 1e6:5.0f} "
                      f"TFLOP/s  err {err:.1e}")
            except Exception as e:  # noqa: BLE001
                print(f"     {name:<24} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        for odd_m in (M - 3, 16):  # cuBLASLt's block modes want M % 4 == 0 (vLLM pads M)
            try:
                xo = xq[:odd_m]
                torch._scaled_mm(xo, ws[0].t(), scale_a=x_blk_cm[:odd_m].t().contiguous().t(), scale_b=w_blk.t(),
                                 out_dtype=torch.bfloat16)
                print(f"     block 1x128 x 128x128 at M={odd_m}: runs")
            except Exception as e:  # noqa: BLE001
                reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                print(f"     block 1x128 x 128x128 at M={odd_m}: FAILED {reason}")
        del ws, w16
        torch.cuda.empty_cache()


@section("the engine's FP8 large-M paths (fp8_w8a8_linear) and the activation quantization alone")
def engine_fp8_paths(N: int, K: int, M: int):
    num_copies = max(2, math.ceil(bqk.L2_DEFEAT_BYTES / (N * K)))
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w16 = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    bf16_us = timed(lambda i: F.linear(x, w16[i % 2]), 2)
    del w16
    for group_cols in (K, 128):
        us = timed(lambda i, g=group_cols: quant_w8a8.quantize_activations(x, g), 8)
        gbps = M * K * 3 / us / 1e3
        print(f"   quantize_activations M={M} K={K} group {group_cols}: {us:.1f} us ({gbps:.0f} GB/s, "
              f"{100 * us / bf16_us:.0f}% of the bf16 GEMM)")
    for variant in ("fp8ch", "fp8ch-tri", "fp8blk", "fp8blk-smm"):
        copies = [bqk.make_weights(variant, N, K) for _ in range(num_copies)]
        y = bqk.call(variant, x, copies[0])
        err = rel_err(y, x.float() @ bqk.dequantized(variant, copies[0]).T)
        us = timed(lambda i, v=variant, c=copies: bqk.call(v, x, c[i % num_copies]), num_copies)
        print(f"   {variant:<11} M={M}: {us:8.1f} us {bf16_us / us:5.2f}x bf16 (bf16 {bf16_us:.1f} us)  err {err:.1e}")
        del copies
        torch.cuda.empty_cache()


def _kernel_resources(kernel) -> str:
    """Registers and spilled bytes of the kernel's compiled variants (Triton's per-device cache), if exposed."""
    try:
        found = []
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                found.append(f"{compiled.n_regs} regs/{compiled.n_spills} spills")
        return ", ".join(found) or "?"
    except Exception:  # noqa: BLE001
        return "?"


@section("decode kernels: us, % of copy bandwidth (weights + scales + mins read), registers and spills")
def decode_kernels(shapes: list, copy_bw: float):
    for name in shapes:
        N, K = bqk.SHAPES[name]
        for variant in ("bf16", "w4", "w4-mma", "w8", "fp8blk", "fp8blk-mma", "fp8ch"):
            first = bqk.make_weights(variant, N, K)
            num_copies = max(2, min(64, math.ceil(bqk.L2_DEFEAT_BYTES / bqk.bytes_read(first))))
            copies = [first] + [bqk.make_weights(variant, N, K) for _ in range(num_copies - 1)]
            cells = []
            for M in (1, 2, 16):
                if variant in bqk.SMALL_M_ONLY and M > 2:
                    continue
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                us = timed(lambda i, v=variant, x=x: bqk.call(v, x, copies[i % num_copies]), num_copies)
                cells.append(f"M={M} {us:6.1f} us {100 * bqk.bytes_read(first) / us / 1e3 / copy_bw:3.0f}%")
            print(f"   {name:>8} {variant:<11} " + "  ".join(cells))
            del copies, first
            torch.cuda.empty_cache()
    for kernel in (quant_gemv._int4_gemv_kernel, quant_gemv._byte_gemv_kernel, quant_gemm._wo_gemm_kernel):
        print(f"   {kernel.fn.__name__}: {_kernel_resources(kernel)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gate_up", choices=list(bqk.SHAPES))
    parser.add_argument("--m", type=int, nargs="+", default=[1024, 4096])
    args = parser.parse_args()
    started = time.monotonic()
    torch.backends.cuda.matmul.allow_tf32 = False
    environment()
    N, K = bqk.SHAPES[args.shape]
    scaled_mm_modes(N, K, args.m)
    engine_fp8_paths(N, K, args.m[0])
    copy_bw = bqk.copy_gbps()
    print(f"== copy bandwidth (1 GiB copy_, read + write): {copy_bw:.0f} GB/s")
    decode_kernels(["qkv", "gate_up"], copy_bw)
    print(f"probe done in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
