"""The launches of the weight-only kernels (quant_gemm.py, quant_gemv.py, quant_gemv_rows.py,
quant_gemm_swapped.py): each kernel's grid and arguments from a plan (quant_plans.py) and from where it writes
(SplitLaunch). quant_matmul.weight_only_linear picks the plan, makes the split-K scratch and calls launch_weight_only.
"""
from dataclasses import dataclass

import torch
import triton

from nanovllm.kernels import quant_gemm, quant_gemm_swapped, quant_gemv, quant_gemv_rows
from nanovllm.kernels.quant_plans import TilePlan
from nanovllm.kernels.quant_w8a8 import interpreting


@dataclass(frozen=True)
class SplitLaunch:
    """Where a weight-only kernel writes: target (fp32 partials [splits, M, N] when split-K, else out itself), and
    for the in-kernel reduction the output and the tile counters (locks; unused and set to out otherwise).
    add_out: the result is added to out's old values (the kernels' ADD_OUT, quant_gemm.py's docstring)."""
    target: torch.Tensor
    out: torch.Tensor
    locks: torch.Tensor
    reduce_in_kernel: bool
    add_out: bool

    def split_stride(self) -> int:
        return self.target.stride(0) if self.target.dim() == 3 else 0


def launch_weight_only(x, qweight, scales, mins, launch: SplitLaunch, kind: int, group_n: int, group_k: int,
                       plan: TilePlan):
    """The plan's kernel for x [M, K] @ dequant(qweight).T, written as `launch` says (no second launch here)."""
    if plan.cuda_cores and kind in (quant_gemm.KIND_FP8, quant_gemm.KIND_INT8):
        if mins is not None:
            raise ValueError(f"a CUDA-core plan for 8-bit weights has no min term; {plan} came with mins (plan with "
                             f"plan_weight_only(..., has_mins=True))")
        _launch_byte_gemv(x, qweight, scales, launch, group_n, group_k, plan)
    elif plan.multi_row:
        _launch_int4_gemv_rows(x, qweight, scales, mins, launch, group_k, plan)
    elif plan.cuda_cores:
        _launch_int4_gemv(x, qweight, scales, mins, launch, group_k, plan)
    elif plan.swap_ab:
        _launch_w4_swapped_gemm(x, qweight, scales, mins, launch, group_k, plan)
    else:
        _launch_wo_gemm(x, qweight, scales, mins, launch, kind, group_n, group_k, plan)


def _offset_bits(dtype: torch.dtype, kind: int) -> tuple[int, int]:
    """(OFFSET, OFFSET_BITS) of the 4-bit unpack: the 16-bit float with these bits | q is OFFSET + q, exactly."""
    if kind != quant_gemm.KIND_INT4:
        return 0, 0
    return (128, 0x4300) if dtype == torch.bfloat16 else (1024, 0x6400)


def _launch_int4_gemv(x, qweight, scales, mins, launch: SplitLaunch, group_k: int, plan: TilePlan):
    M, N = x.shape[0], qweight.shape[0]
    quant_gemv._int4_gemv_kernel[(triton.cdiv(N, plan.block_n), plan.num_splits)](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N,
        x.shape[1], plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, ADD_OUT=launch.add_out, GROUP_K=group_k, HAS_MINS=mins is not None,
        TWO_ROWS=M > 1, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps,
        num_stages=plan.num_stages)


def _launch_int4_gemv_rows(x, qweight, scales, mins, launch: SplitLaunch, group_k: int, plan: TilePlan):
    M, N = x.shape[0], qweight.shape[0]
    if M > plan.block_m:
        raise ValueError(f"M={M} rows exceed the multi-row plan's block_m={plan.block_m}; plan for M rows")
    quant_gemv_rows._int4_gemv_rows_kernel[(triton.cdiv(N, plan.block_n), plan.num_splits)](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N,
        x.shape[1], plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, ADD_OUT=launch.add_out, GROUP_K=group_k, HAS_MINS=mins is not None,
        ROWS=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps,
        num_stages=plan.num_stages)


def _launch_byte_gemv(x, qweight, scales, launch: SplitLaunch, group_n: int, group_k: int, plan: TilePlan):
    (M, K), N = x.shape, qweight.shape[0]
    quant_gemv._byte_gemv_kernel[(triton.cdiv(N, plan.block_n), plan.num_splits)](
        x, qweight, scales, launch.target, launch.out, launch.locks, M, N, K, plan.num_k_steps, plan.num_splits,
        x.stride(0), qweight.stride(0), scales.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, ADD_OUT=launch.add_out, GROUP_N=group_n, GROUP_K=group_k,
        TWO_ROWS=M > 1, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps,
        num_stages=plan.num_stages)


def _launch_wo_gemm(x, qweight, scales, mins, launch: SplitLaunch, kind: int, group_n: int, group_k: int,
                    plan: TilePlan):
    (M, K), N = x.shape, qweight.shape[0]
    offset, offset_bits = _offset_bits(x.dtype, kind) if plan.scale_after_dot else (0, 0)
    grid = (triton.cdiv(M, plan.block_m) * triton.cdiv(N, plan.block_n), plan.num_splits)
    quant_gemm._wo_gemm_kernel[grid](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N, K,
        plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, ADD_OUT=launch.add_out,
        WEIGHT_KIND=kind, GROUP_N=group_n, GROUP_K=group_k, HAS_MINS=mins is not None,
        SCALE_AFTER_DOT=plan.scale_after_dot, PER_ELEMENT=plan.per_element, OFFSET=offset, OFFSET_BITS=offset_bits,
        EMULATE_DOT_FP32=interpreting() and x.dtype == torch.bfloat16,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8, num_warps=plan.num_warps,
        num_stages=plan.num_stages)


def _launch_w4_swapped_gemm(x, qweight, scales, mins, launch: SplitLaunch, group_k: int, plan: TilePlan):
    (M, K), N = x.shape, qweight.shape[0]
    offset, offset_bits = _offset_bits(x.dtype, quant_gemm.KIND_INT4)
    grid = (triton.cdiv(M, plan.block_m) * triton.cdiv(N, plan.block_n), plan.num_splits)
    quant_gemm_swapped._w4_swapped_gemm_kernel[grid](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N, K,
        plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, ADD_OUT=launch.add_out, GROUP_K=group_k, HAS_MINS=mins is not None,
        OFFSET=offset, OFFSET_BITS=offset_bits, EMULATE_DOT_FP32=interpreting() and x.dtype == torch.bfloat16,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps,
        num_stages=plan.num_stages)
