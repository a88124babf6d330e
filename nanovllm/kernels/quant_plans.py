"""Which weight-only kernel runs for a shape, and how it is tiled and split along K (quant_gemm.py's kernels;
quant_matmul.py launches them). Chosen on the host from M, N, K and the device's SM count: no autotuning, so no
timing run can land inside a CUDA graph capture or a served step."""
import functools
from dataclasses import dataclass

import torch
import triton

from nanovllm.kernels import quant_gemm

_MAX_BLOCK_K = 128  # a K step; 128 holds a whole group of the common G = 128
SCALE_AFTER_DOT_MAX_ROWS = 32  # taller tiles dequantize the tile instead (quant_gemm.py's docstring says why)
# weights of each kind at up to this many rows run on the CUDA cores. 4-bit: the one-row kernel streamed 1.6-2.9x
# the 16-row dot kernel's rate on an H100 and the two-row one 1.5x; FP8: the one-row kernel ~1.2x on qkv, but the
# two-row one (~225 registers a thread, one program an SM) fell to 0.6-0.8x the dot kernel
CUDA_CORE_MAX_ROWS = {quant_gemm.KIND_INT4: 2, quant_gemm.KIND_FP8: 1}
# split-K: the 4-warp decode programs (~128 registers a thread) fit four to an SM's 64K registers, and all of them
# resident keep the most loads in flight; a split streams at least 4 steps so that its 4-stage pipeline fills.
# Larger tiles split only to fill one wave.
_DECODE_PROGRAMS_PER_SM = 4
_MIN_STEPS_PER_SPLIT = 4


@dataclass(frozen=True)
class TilePlan:
    """Tile shape and K split of one weight-only GEMM launch; num_k_steps K steps of block_k per split."""
    block_m: int
    block_n: int
    block_k: int
    num_splits: int
    num_k_steps: int
    num_warps: int
    num_stages: int
    per_element: bool  # the group cannot align with a K step: dequantize per element (any group size, slower)
    scale_after_dot: bool  # the raw weights go into the dot, the scales multiply its result (quant_gemm.py)
    cuda_cores: bool = False  # 1-2 rows: quant_gemm's _int4_gemv_kernel / _fp8_gemv_kernel, fmas, no dot


@dataclass(frozen=True)
class DeviceLimits:
    num_sms: int
    shared_memory_bytes: int  # per block, opt-in


H100_LIMITS = DeviceLimits(132, 232448)  # what plans assume without a GPU (the interpreter, the compile tests)


@functools.cache
def device_limits(device: torch.device) -> DeviceLimits:
    if device.type != "cuda":
        return H100_LIMITS
    props = torch.cuda.get_device_properties(device)
    return DeviceLimits(props.multi_processor_count,
                        getattr(props, "shared_memory_per_block_optin", H100_LIMITS.shared_memory_bytes))


def aligned_block_k(group_k: int, limit: int = _MAX_BLOCK_K) -> int:
    """The largest power of two <= limit that divides group_k, or 0 if below 16 (tl.dot's smallest K)."""
    block_k = limit
    while block_k >= 16 and group_k % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else 0


def plan_weight_only(M: int, N: int, K: int, group_k: int, limits: DeviceLimits = H100_LIMITS,
                     weight_kind: int | None = None, group_n: int = 1) -> TilePlan:
    """Up to 32 rows (decode): 16- or 32-row tiles of 64 columns, 4 warps, the scales after the dot, K steps of up
    to 128 columns, and K split until ~4 programs per SM (split_k): each weight is read once and the split keeps
    enough loads in flight. 33-64 rows: 64 x 64 tiles. Larger M: 128 x 128 tiles, 64-column K steps, 8 warps, 4 stages
    (one accumulator of 64 fp32 registers per thread; ~190 registers and no spills on sm_90 for 4-bit weights),
    each step's tile dequantized before the dot. Devices with under 160 KB of shared memory per block (sm_89) get
    64 x 128 tiles with 4 warps and 3 stages. 4-bit weights at 1-2 rows take the CUDA-core kernel (128 columns,
    4 warps, _int4_gemv_kernel's docstring says why), and so do FP8 weights at 1 row whose scales fit
    _fp8_gemv_kernel (one scale column, or blocks of a multiple of 64 rows): CUDA_CORE_MAX_ROWS."""
    small_smem = limits.shared_memory_bytes < 160 * 1024
    block_k = aligned_block_k(group_k)
    if M <= CUDA_CORE_MAX_ROWS.get(weight_kind, 0) and _fits_cuda_core_kernel(weight_kind, K, group_n, group_k):
        block_k = block_k or 128  # FP8 with one scale column: any K step
        # 128 columns of 4-bit words, 64 of FP8 values: a thread holds 64 values either way, and for FP8 its
        # [64, 128] fp32 accumulator per row (128 columns spilled with two rows on sm_90)
        block_n = 128 if weight_kind == quant_gemm.KIND_INT4 else 64
        num_splits, num_k_steps = split_k(M, N, K, 1, block_n, block_k, limits, _DECODE_PROGRAMS_PER_SM)
        return TilePlan(1, block_n, block_k, num_splits, num_k_steps, 4, 1, False, True, cuda_cores=True)
    if M <= SCALE_AFTER_DOT_MAX_ROWS:
        block_m, block_n, num_warps, num_stages, max_block_k = max(16, triton.next_power_of_2(M)), 64, 4, 4, 128
    elif M <= 64:
        block_m, block_n, num_warps, num_stages, max_block_k = 64, 64, 4, 4, 128
    elif small_smem:
        block_m, block_n, num_warps, num_stages, max_block_k = 64, 128, 4, 3, 64
    else:
        block_m, block_n, num_warps, num_stages, max_block_k = 128, 128, 8, 4, 64
    block_k = aligned_block_k(group_k, 64 if small_smem else max_block_k)
    per_element = block_k == 0
    if per_element:
        block_k = 32
    scale_after_dot = not per_element and block_m <= SCALE_AFTER_DOT_MAX_ROWS
    num_splits, num_k_steps = split_k(M, N, K, block_m, block_n, block_k, limits,
                                      _DECODE_PROGRAMS_PER_SM if block_m <= 64 else 1)
    return TilePlan(block_m, block_n, block_k, num_splits, num_k_steps, num_warps, num_stages, per_element,
                    scale_after_dot)


def _fits_cuda_core_kernel(weight_kind: int | None, K: int, group_n: int, group_k: int) -> bool:
    """4-bit weights whose group a dot step can hold; FP8 weights with one scale column, or with blocks of a
    multiple of 64 rows and of 16 columns (a 64-column program sees one scale per step)."""
    if weight_kind == quant_gemm.KIND_INT4:
        return aligned_block_k(group_k) > 0
    if weight_kind == quant_gemm.KIND_FP8:
        return group_k >= K or (group_n % 64 == 0 and aligned_block_k(group_k) > 0)
    return False


def split_k(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int, limits: DeviceLimits,
            programs_per_sm: int) -> tuple[int, int]:
    """(num_splits, num_k_steps per split): the K steps split until the tiles make about programs_per_sm programs
    per SM, each split keeping at least _MIN_STEPS_PER_SPLIT steps, and no split empty."""
    total_steps = triton.cdiv(K, block_k)
    num_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    num_splits = max(1, min(programs_per_sm * limits.num_sms // num_tiles, total_steps // _MIN_STEPS_PER_SPLIT))
    num_k_steps = triton.cdiv(total_steps, num_splits)
    return triton.cdiv(total_steps, num_k_steps), num_k_steps
