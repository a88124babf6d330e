"""FP8 weights at large M (W8A8): the activations quantized to e4m3 per token, or per token and per weight scale
block along K, by one kernel (quant_fp8._quantize_act_kernel), then an FP8 tensor-core GEMM: torch._scaled_mm
(cuBLASLt) where it runs, quant_fp8.py's Triton GEMM elsewhere. quant_matmul.fp8_linear calls fp8_w8a8_linear
from FP8_ACT_QUANT_MIN_ROWS rows on.

torch._scaled_mm on an H100 (torch 2.11, CUDA 13), a Qwen3-8B gate_up at 1,024 and 4,096 rows: per-tensor 1.71-1.76x
bf16 cuBLAS, rowwise 1.48-1.51x (1.82-1.84x with fast accumulation, at twice the error), 1 x 128 / 128 x 128 blocks
1.57-1.60x; per-row 1 x 128 weight scales are refused ("Invalid scaling configuration"), and the block modes refuse
M not a multiple of 4 (CUBLAS_STATUS_NOT_SUPPORTED), so M is padded. Quantizing the activations takes ~4 us at
1,024 rows, ~1% of the GEMM.
"""
import functools
import os

import torch
import triton

from nanovllm.kernels import quant_fp8
from nanovllm.kernels.quant_plans import DeviceLimits, device_limits
from nanovllm.utils.switches import SWITCHES


def interpreting() -> bool:
    """Triton's CPU interpreter runs the kernels (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


_QUANT_CHUNK_COLS = 16384  # a row's tile in _quantize_act_kernel: 64 fp32 values a thread at 8 warps, no spills


def quantize_activations(x: torch.Tensor, group_cols: int, scales_column_major: bool = False,
                         pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M', K], fp32 scales [M', ceil(K / group_cols)]): per token and per group_cols columns,
    scale = max|x| / 448 over the group (quant_fp8.py), one kernel. group_cols is a power of two (a weight's
    scale block), or >= K for one scale per token. scales_column_major: the layout that torch._scaled_mm's 1 x 128
    block scaling takes (stride (1, M')). M' is M rounded up to pad_rows_to; the padding rows are zeros."""
    M, K = x.shape
    per_token = group_cols >= K
    if not per_token and (group_cols < 1 or group_cols & (group_cols - 1)):
        raise ValueError(f"group_cols={group_cols} must be a power of two or >= K={K}")
    group = 128 if per_token else group_cols  # per token: the row is read in 128-column pieces
    num_groups = 1 if per_token else triton.cdiv(K, group_cols)
    groups_per_chunk = min(triton.next_power_of_2(triton.cdiv(K, group)), max(1, _QUANT_CHUNK_COLS // group))
    num_chunks = triton.cdiv(K, groups_per_chunk * group)
    padded_m = triton.cdiv(M, pad_rows_to) * pad_rows_to
    # Triton's CPU interpreter rounds some values to the wrong e4m3 binade (126.5 -> 64): there the kernel writes
    # the scaled fp32 values and torch rounds them
    round_in_torch = interpreting()
    xq = torch.empty((padded_m, K), dtype=torch.float32 if round_in_torch else torch.float8_e4m3fn, device=x.device)
    if scales_column_major:
        xs = torch.empty((num_groups, padded_m), dtype=torch.float32, device=x.device).t()
    else:
        xs = torch.empty((padded_m, num_groups), dtype=torch.float32, device=x.device)
    if padded_m:
        num_warps = 8 if groups_per_chunk * group > 4096 else 4
        quant_fp8._quantize_act_kernel[(padded_m,)](
            x, xq, xs, M, K, x.stride(0), xq.stride(0), xs.stride(0), xs.stride(1), GROUP=group,
            GROUPS_PER_CHUNK=groups_per_chunk, NUM_CHUNKS=num_chunks, PER_TOKEN=per_token, num_warps=num_warps)
    return (xq.to(torch.float8_e4m3fn) if round_in_torch else xq), xs


def _scaled_mm_rowwise(xq, xs, qweight, scales, group_n: int, dtype) -> torch.Tensor:
    """torch._scaled_mm with per-token activation scales and per-output-column weight scales."""
    N = qweight.shape[0]
    if group_n == 1:
        w_scale = scales.view(1, N)  # per-channel: [N, 1] contiguous
    else:  # per-tensor (one scale) or row blocks without K blocks: one scale per column
        w_scale = scales[:, 0].repeat_interleave(group_n)[:N].view(1, N)
    return torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=w_scale, out_dtype=dtype)


def _scaled_mm_blockwise(xq, xs, qweight, scales, dtype) -> torch.Tensor:
    """torch._scaled_mm with 1 x 128 activation scales (column-major [M, K / 128]) and 128 x 128 weight blocks
    (scales [N / 128, K / 128] row-major, passed transposed: the [K / 128, N / 128] layout, K-blocks-major, that
    cuBLASLt reads; it wants K / 128 a multiple of 4, _can_scaled_mm checks)."""
    return torch._scaled_mm(xq, qweight.t(), scale_a=xs, scale_b=scales.t(), out_dtype=dtype)


_SCALED_MM_BLOCK_ROWS = 4  # cuBLASLt's block scaling wants M a multiple of 4 (vLLM pads M the same way)


@functools.cache
def _has_block_scaled_mm(device: torch.device) -> bool:
    """cuBLASLt's 1 x 128 / 128 x 128 block scaling through torch._scaled_mm: torch 2.9+ built with CUDA 12.9+,
    on sm_90 only (torch checks the same)."""
    torch_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    cuda_version = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return (torch_version >= (2, 9) and cuda_version >= (12, 9)
            and torch.cuda.get_device_capability(device) == (9, 0))


def _can_scaled_mm(x: torch.Tensor, N: int, K: int, block: tuple[int, int] | None = None) -> bool:
    """torch._scaled_mm's rowwise mode (block None): CUDA, bf16 output, K and N multiples of 16; its 128 x 128
    block mode also needs _has_block_scaled_mm and K and N multiples of 128 with K / 128 a multiple of 4."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or K % 16 or N % 16:
        return False
    if block is None:
        return True
    return block == (128, 128) and K % 512 == 0 and N % 128 == 0 and _has_block_scaled_mm(x.device)


def fp8_w8a8_linear(x, qweight, scales, group_n: int, group_k: int, use_scaled_mm: bool | None = None,
                    limits: DeviceLimits | None = None) -> torch.Tensor:
    """x [M, K] quantized per token (and per group_k columns when the weight scales change along K), then an FP8
    tensor-core GEMM: torch._scaled_mm (cuBLASLt) where it runs, else quant_fp8.py's Triton GEMM. use_scaled_mm
    None: the switches (utils/switches.py) fp8_scaled_mm for per-channel and per-tensor weights,
    fp8_block_scaled_mm for blocks; True or False forces either way where it can run."""
    M, K = x.shape
    N = qweight.shape[0]
    per_step = scales.shape[1] > 1
    if per_step:
        blockwise = SWITCHES.fp8_block_scaled_mm if use_scaled_mm is None else use_scaled_mm
        if blockwise and _can_scaled_mm(x, N, K, (group_n, group_k)):
            xq, xs = quantize_activations(x, group_k, scales_column_major=True, pad_rows_to=_SCALED_MM_BLOCK_ROWS)
            return _scaled_mm_blockwise(xq, xs, qweight, scales, x.dtype)[:M]
    xq, xs = quantize_activations(x, group_k if per_step else K)
    rowwise = SWITCHES.fp8_scaled_mm if use_scaled_mm is None else use_scaled_mm
    if not per_step and rowwise and _can_scaled_mm(x, N, K):
        return _scaled_mm_rowwise(xq, xs, qweight, scales, group_n, x.dtype)
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    small_smem = (limits or device_limits(x.device)).shared_memory_bytes < 160 * 1024
    block_m, block_n, num_warps, num_stages = (64, 128, 4, 2) if small_smem else (128, 128, 8, 4)
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    quant_fp8._fp8_gemm_kernel[grid](
        xq, xs, qweight, scales, out, M, N, K, xq.stride(0), xs.stride(0), xs.stride(1), qweight.stride(0),
        scales.stride(0), out.stride(0), GROUP_N=group_n, PER_STEP_SCALES=per_step, EMULATE_DOT_FP32=False,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=group_k if per_step else 128, GROUP_M=8, num_warps=num_warps,
        num_stages=num_stages)
    return out
