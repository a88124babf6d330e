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
    cuda_cores: bool = False  # quant_gemv's _int4_gemv_kernel / _byte_gemv_kernel, fmas, no dot
    multi_row: bool = False  # with cuda_cores: quant_gemv_rows' kernel, block_m (a power of two >= M) rows a program
    swap_ab: bool = False  # 4-bit, the scales after the dot: quant_gemm_swapped's kernel (the weights first)


@dataclass(frozen=True)
class DecodeTiles:
    """How 4-bit weights are tiled at up to max_rows rows: one entry of W4_DECODE_TILES. Plain data, so that a
    sweep's winners (benchmarks/sweep_w4.py) become the plan by editing constants: the plan stays a pure function of
    the shape on the host (CUDA graphs replay it; no timing run at serve time)."""
    max_rows: int
    kernel: str  # "gemv": quant_gemv._int4_gemv_kernel (1-2 rows); "rows": quant_gemv_rows (ROWS = M rounded up
    # to a power of two, at least 2); "dot": quant_gemm._wo_gemm_kernel, max(16, M rounded up) rows a tile;
    # "dot_swapped": quant_gemm_swapped (the weights the dot's first operand), tiles as "dot"
    block_n: int
    block_k: int  # the largest K step: the plan takes the largest power of two <= it that divides the group
    num_warps: int
    programs_per_sm: int  # K is split until the tiles make about this many programs per SM (split_k)
    num_stages: int = 1  # the dot kernel's software pipeline; the CUDA-core kernels prefetch in registers


# 4-bit decode tiles by row count, the first entry whose max_rows >= M; larger M (or a group no K step divides)
# takes plan_weight_only's generic tiles. The one-row CUDA-core kernel streamed 1.6-2.9x the 16-row dot kernel's
# rate on an H100 and the two-row one 1.5x; 128 columns and 4 warps hold 64 values a thread
# (_int4_gemv_kernel's docstring). _DECODE_PROGRAMS_PER_SM says why four programs an SM.
W4_DECODE_TILES = (
    DecodeTiles(max_rows=2, kernel="gemv", block_n=128, block_k=128, num_warps=4,
                programs_per_sm=_DECODE_PROGRAMS_PER_SM),
    DecodeTiles(max_rows=16, kernel="dot_swapped", block_n=64, block_k=128, num_warps=4,
                programs_per_sm=_DECODE_PROGRAMS_PER_SM, num_stages=4),
)
# gemv: TWO_ROWS; rows: registers; the dots: SCALE_AFTER_DOT_MAX_ROWS
_KERNEL_MAX_ROWS = {"gemv": 2, "rows": 16, "dot": 32, "dot_swapped": 32}


def check_decode_tiles(tiles: tuple[DecodeTiles, ...]):
    """ValueError naming the entry that breaks the table's rules: row ranges ascending, each kernel within its row
    limit, powers of two for the tile sizes."""
    last_rows = 0
    for t in tiles:
        if t.kernel not in _KERNEL_MAX_ROWS or not last_rows < t.max_rows <= _KERNEL_MAX_ROWS[t.kernel]:
            raise ValueError(f"{t}: max_rows must exceed the previous entry's ({last_rows}) and stay within "
                             f"{_KERNEL_MAX_ROWS.get(t.kernel)} for kernel {t.kernel!r} "
                             f"(one of {list(_KERNEL_MAX_ROWS)})")
        for name in ("block_n", "block_k", "num_warps", "programs_per_sm"):
            value = getattr(t, name)
            if value < 1 or value & (value - 1) or (name == "block_k" and value < 16):
                raise ValueError(f"{t}: {name}={value} must be a power of two (block_k at least 16)")
        last_rows = t.max_rows


check_decode_tiles(W4_DECODE_TILES)


def w4_decode_tiles(M: int) -> DecodeTiles | None:
    return next((t for t in W4_DECODE_TILES if M <= t.max_rows), None)


def w4_cuda_core_max_rows() -> int:
    """The most rows at which every smaller row count runs 4-bit weights on the CUDA cores (0 if 1 row does not)."""
    rows = 0
    for t in W4_DECODE_TILES:
        if t.kernel in ("dot", "dot_swapped"):
            break
        rows = t.max_rows
    return rows


# weights of each kind at up to this many rows run on the CUDA cores. FP8: the one-row kernel ~1.2x the dot kernel on
# qkv on an H100, but the two-row one (~225 registers a thread, one program an SM) fell to 0.6-0.8x; int8 (without
# mins: the 8-bit LM head) takes the same kernel, where the 16-row dot tile read 8-bit weights at ~40% of copy
# bandwidth at one row on an H100; 4-bit: the leading CUDA-core entries of W4_DECODE_TILES
CUDA_CORE_MAX_ROWS = {quant_gemm.KIND_INT4: w4_cuda_core_max_rows(), quant_gemm.KIND_FP8: 1, quant_gemm.KIND_INT8: 1}


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
                     weight_kind: int | None = None, group_n: int = 1, has_mins: bool = False) -> TilePlan:
    """Up to 32 rows (decode): 16- or 32-row tiles of 64 columns, 4 warps, the scales after the dot, K steps of up
    to 128 columns, and K split until ~4 programs per SM (split_k): each weight is read once and the split keeps
    enough loads in flight. 33-64 rows: 64 x 64 tiles. Larger M: 128 x 128 tiles, 64-column K steps, 8 warps, 4 stages
    (one accumulator of 64 fp32 registers per thread; ~190 registers and no spills on sm_90 for 4-bit weights),
    each step's tile dequantized before the dot. Devices with under 160 KB of shared memory per block (sm_89) get
    64 x 128 tiles with 4 warps and 3 stages. 4-bit weights up to 16 rows take the kernel and tiles of
    W4_DECODE_TILES (plan_w4_decode); FP8 weights, and int8 ones without mins (has_mins), at 1 row whose scales fit
    _byte_gemv_kernel (one scale column, or blocks of a multiple of 64 rows) its CUDA-core kernel:
    CUDA_CORE_MAX_ROWS."""
    small_smem = limits.shared_memory_bytes < 160 * 1024
    if weight_kind == quant_gemm.KIND_INT4 and aligned_block_k(group_k) and w4_decode_tiles(M) is not None:
        return plan_w4_decode(M, N, K, group_k, w4_decode_tiles(M), limits)
    byte_kernel_takes = weight_kind == quant_gemm.KIND_FP8 or (weight_kind == quant_gemm.KIND_INT8 and not has_mins)
    if byte_kernel_takes and M <= CUDA_CORE_MAX_ROWS[weight_kind] and _fits_cuda_core_kernel(K, group_n, group_k):
        block_k = aligned_block_k(group_k) or 128  # one scale column: any K step
        # 64 columns: a thread holds 64 values and its [64, 128] fp32 accumulator per row (128 columns spilled with
        # two rows on sm_90)
        num_splits, num_k_steps = split_k(M, N, K, 1, 64, block_k, limits, _DECODE_PROGRAMS_PER_SM)
        return TilePlan(1, 64, block_k, num_splits, num_k_steps, 4, 1, False, True, cuda_cores=True)
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


def plan_w4_decode(M: int, N: int, K: int, group_k: int, tiles: DecodeTiles,
                   limits: DeviceLimits = H100_LIMITS) -> TilePlan:
    """The plan of one W4_DECODE_TILES entry at M rows (group_k aligned: a K step of 16 or more divides it)."""
    block_k = aligned_block_k(group_k, tiles.block_k)
    if tiles.kernel in ("dot", "dot_swapped"):
        block_m = max(16, triton.next_power_of_2(M))
        if limits.shared_memory_bytes < 160 * 1024:  # sm_89: the stages of 128-column K steps do not fit
            block_k = aligned_block_k(group_k, min(64, tiles.block_k))
    else:
        block_m = 1 if tiles.kernel == "gemv" else max(2, triton.next_power_of_2(M))
    num_splits, num_k_steps = split_k(M, N, K, block_m, tiles.block_n, block_k, limits, tiles.programs_per_sm)
    return TilePlan(block_m, tiles.block_n, block_k, num_splits, num_k_steps, tiles.num_warps, tiles.num_stages,
                    False, True, cuda_cores=tiles.kernel in ("gemv", "rows"), multi_row=tiles.kernel == "rows",
                    swap_ab=tiles.kernel == "dot_swapped")


def _fits_cuda_core_kernel(K: int, group_n: int, group_k: int) -> bool:
    """8-bit weights with one scale column, or with blocks of a multiple of 64 rows and of 16 columns (a 64-column
    program sees one scale per step)."""
    return group_k >= K or (group_n % 64 == 0 and aligned_block_k(group_k) > 0)


def split_k(M: int, N: int, K: int, block_m: int, block_n: int, block_k: int, limits: DeviceLimits,
            programs_per_sm: int) -> tuple[int, int]:
    """(num_splits, num_k_steps per split): the K steps split until the tiles make about programs_per_sm programs
    per SM, each split keeping at least _MIN_STEPS_PER_SPLIT steps, and no split empty."""
    total_steps = triton.cdiv(K, block_k)
    num_tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    num_splits = max(1, min(programs_per_sm * limits.num_sms // num_tiles, total_steps // _MIN_STEPS_PER_SPLIT))
    num_k_steps = triton.cdiv(total_steps, num_splits)
    return triton.cdiv(total_steps, num_k_steps), num_k_steps
