"""Quantized linear layers on CUDA: `int_linear` (4- or 8-bit integer groups) and `fp8_linear` (e4m3 with block,
per-channel or per-tensor scales), y [M, N] = x [M, K] @ dequant(W) [N, K].T in x's dtype, fp32 accumulation.

The weight layouts (the shared contract with the checkpoint loaders):
  - "int", group size G along K: 4-bit `qweight` int32 [N, K // 8], element (n, k) the unsigned nibble
    (qweight[n, k // 8] >> 4 * (k % 8)) & 0xF; 8-bit `qweight` int8 [N, K]. `scales` and optional `mins`
    [N, K // G] in fp16, bf16 or fp32. w[n, k] = q * scales[n, k // G] (+ mins[n, k // G]).
  - "fp8": `qweight` float8_e4m3fn [N, K], `scales` fp32 [ceil(N / bn), ceil(K / bk)] for block (bn, bk):
    (128, 128) blocks, per-channel (1, K), per-tensor (N, K). w[n, k] = q * scales[n // bn, k // bk].

Which kernel runs (a plan per shape, quant_plans.py):
  - weight-only (quant_gemm.py): the weights are dequantized in registers and multiplied with the 16-bit
    activations. M <= 64 uses 16-64-row tiles with split-K (decode: the weights are read once, the GPU's loads
    kept in flight by slicing K), and 4-bit and FP8 weights at 1-2 rows CUDA-core kernels, also split-K (4-bit:
    which kernel at which row count is quant_plans.W4_DECODE_TILES, up to 16 rows, with quant_gemv_rows.py's);
    larger M uses 128 x 128 tiles, except that "int" weights from DEQUANT_GEMM_MIN_ROWS rows on are dequantized
    to x's dtype in one pass (quant_dequant.py; in row chunks where the memory budget bounds the scratch) and
    multiplied by cuBLAS, as vLLM does for AWQ at large batches.
  - FP8 weights at M >= FP8_ACT_QUANT_MIN_ROWS (quant_w8a8.py): activations quantized to e4m3 per token (and per
    bk columns for block weights) by one kernel (quant_fp8.py), then an FP8 tensor-core GEMM: torch._scaled_mm
    (cuBLASLt) with rowwise scales for per-channel and per-tensor weights (switch `fp8_scaled_mm`) and with 1 x 128
    / 128 x 128 block scales for 128 x 128 block weights on sm_90 (`fp8_block_scaled_mm`); quant_fp8.py's Triton
    GEMM where those cannot run (sm_89, other block shapes, fp16 activations).
Both functions are torch custom ops (`torch.ops.nanovllm.int_linear`, `.fp8_linear`): torch.compile treats them as
opaque calls, and CUDA graphs capture them (no host sync; the split-K partials come from the caching allocator).
On CPU tensors they run only under Triton's interpreter (TRITON_INTERPRET=1, the tests); the engine's CPU path
dequantizes and calls F.linear.
"""
import typing
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton

from nanovllm.kernels import quant_dequant, quant_gemm, quant_gemm_swapped, quant_gemv, quant_gemv_rows
from nanovllm.kernels.quant_plans import (SCALE_AFTER_DOT_MAX_ROWS, TilePlan, device_limits,
                                          plan_weight_only)
from nanovllm.kernels.quant_w8a8 import _has_fp8_tensor_cores, fp8_w8a8_linear, interpreting
from nanovllm.utils.switches import SWITCHES

# FP8 weights from this many rows on quantize the activations and run an FP8 GEMM; below, the weight-only decode
# tiles (bf16 dot, exact x, the scales after the dot) run. Above 32 rows those tiles dequantize each weight tile
# (SCALE_AFTER_DOT_MAX_ROWS) and ran at ~175 TFLOP/s on an H100, where cuBLASLt's FP8 GEMM streams the same weight
# bytes and multiplies at the FP8 rate (1.6x bf16 cuBLAS at 1,024 rows)
FP8_ACT_QUANT_MIN_ROWS = SCALE_AFTER_DOT_MAX_ROWS + 1
# "int" weights at this many rows or more: the weight dequantized to x's dtype in one pass (quant_dequant.py), then
# cuBLAS. Measured on an H100, the 128-row Triton tiles ran at ~175 TFLOP/s for 4-bit and ~340 for 8-bit against
# cuBLAS bf16's ~780; with one pass over the weights at copy bandwidth 4-bit breaks even near M = 128 (qkv: 58 us tiles,
# ~31 + 22 us dequant + GEMM) and wins 3x by M = 512; 8-bit's tiles stay ahead up to ~256 rows.
DEQUANT_GEMM_MIN_ROWS = {quant_gemm.KIND_INT4: 128, quant_gemm.KIND_INT8: 256}


def _check_device(x: torch.Tensor, name: str):
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"{name} runs on CUDA only (got x on {x.device}); on the CPU dequantize the weight and call "
                         f"F.linear (TRITON_INTERPRET=1 runs the kernel on CPU tensors, for tests)")


def _offset_bits(dtype: torch.dtype, kind: int) -> tuple[int, int]:
    """(OFFSET, OFFSET_BITS) of the 4-bit unpack: the 16-bit float with these bits | q is OFFSET + q, exactly."""
    if kind != quant_gemm.KIND_INT4:
        return 0, 0
    return (128, 0x4300) if dtype == torch.bfloat16 else (1024, 0x6400)


_NUM_SPLIT_LOCKS = 1 << 14  # tile counters per device: split plans have <= 64 rows, so N / BLOCK_N tiles or fewer
_split_locks: dict[torch.device, torch.Tensor] = {}


def _split_lock_tensor(device: torch.device, num_tiles: int) -> torch.Tensor | None:
    """The device's zeroed int32 tile counters for the in-kernel split-K reduction, made on first use; None (the
    second launch instead) when the reduction is switched off, the tiles outnumber the counters, or the first use
    comes inside a CUDA graph capture (zeros made there would be the graph's, not persistent). The switch
    split_k_reduce (utils/switches.py) picks the reduction: "kernel" (the last program of each tile sums the
    partials, quant_gemm._reduce_splits_if_last) or "launch" (a second kernel, _sum_splits_kernel)."""
    if SWITCHES.split_k_reduce != "kernel" or num_tiles > _NUM_SPLIT_LOCKS:
        return None
    locks = _split_locks.get(device)
    if locks is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        locks = _split_locks[device] = torch.zeros(_NUM_SPLIT_LOCKS, dtype=torch.int32, device=device)
    return locks


def weight_only_linear(x, qweight, scales, mins, kind: int, group_n: int, group_k: int,
                       plan: TilePlan | None = None) -> torch.Tensor:
    """x [M, K] (16-bit, unit column stride) @ dequant(qweight).T -> [M, N] in x.dtype (quant_gemm.py)."""
    M, K = x.shape
    N = qweight.shape[0]
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    plan = plan or plan_weight_only(M, N, K, group_k, device_limits(x.device), kind, group_n, mins is not None)
    split = plan.num_splits > 1
    target = torch.empty((plan.num_splits, M, N), dtype=torch.float32, device=x.device) if split else out
    num_tiles = triton.cdiv(N, plan.block_n) * (1 if plan.cuda_cores else triton.cdiv(M, plan.block_m))
    locks = _split_lock_tensor(x.device, num_tiles) if split else None
    launch = _SplitLaunch(target, out, out if locks is None else locks, locks is not None)
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
    if split and not launch.reduce_in_kernel:
        block = 1024
        quant_gemm._sum_splits_kernel[(triton.cdiv(M * N, block),)](target, out, M * N, plan.num_splits,
                                                                     BLOCK=block, num_warps=4)
    return out


@dataclass(frozen=True)
class _SplitLaunch:
    """Where a weight-only kernel writes: target (fp32 partials [splits, M, N] when split-K, else out itself), and
    for the in-kernel reduction the output and the tile counters (locks; unused and set to out otherwise)."""
    target: torch.Tensor
    out: torch.Tensor
    locks: torch.Tensor
    reduce_in_kernel: bool

    def split_stride(self) -> int:
        return self.target.stride(0) if self.target.dim() == 3 else 0


def _launch_int4_gemv(x, qweight, scales, mins, launch: _SplitLaunch, group_k: int, plan: TilePlan):
    M, N = x.shape[0], qweight.shape[0]
    quant_gemv._int4_gemv_kernel[(triton.cdiv(N, plan.block_n), plan.num_splits)](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N,
        x.shape[1], plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, GROUP_K=group_k, HAS_MINS=mins is not None, TWO_ROWS=M > 1,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages)


def _launch_int4_gemv_rows(x, qweight, scales, mins, launch: _SplitLaunch, group_k: int, plan: TilePlan):
    M, N = x.shape[0], qweight.shape[0]
    if M > plan.block_m:
        raise ValueError(f"M={M} rows exceed the multi-row plan's block_m={plan.block_m}; plan for M rows")
    quant_gemv_rows._int4_gemv_rows_kernel[(triton.cdiv(N, plan.block_n), plan.num_splits)](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N,
        x.shape[1], plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, GROUP_K=group_k, HAS_MINS=mins is not None, ROWS=plan.block_m,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages)


def _launch_byte_gemv(x, qweight, scales, launch: _SplitLaunch, group_n: int, group_k: int, plan: TilePlan):
    (M, K), N = x.shape, qweight.shape[0]
    quant_gemv._byte_gemv_kernel[(triton.cdiv(N, plan.block_n), plan.num_splits)](
        x, qweight, scales, launch.target, launch.out, launch.locks, M, N, K, plan.num_k_steps, plan.num_splits,
        x.stride(0), qweight.stride(0), scales.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, GROUP_N=group_n, GROUP_K=group_k, TWO_ROWS=M > 1,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps, num_stages=plan.num_stages)


def _launch_wo_gemm(x, qweight, scales, mins, launch: _SplitLaunch, kind: int, group_n: int, group_k: int,
                    plan: TilePlan):
    (M, K), N = x.shape, qweight.shape[0]
    offset, offset_bits = _offset_bits(x.dtype, kind) if plan.scale_after_dot else (0, 0)
    grid = (triton.cdiv(M, plan.block_m) * triton.cdiv(N, plan.block_n), plan.num_splits)
    quant_gemm._wo_gemm_kernel[grid](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N, K,
        plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel,
        WEIGHT_KIND=kind, GROUP_N=group_n, GROUP_K=group_k, HAS_MINS=mins is not None,
        SCALE_AFTER_DOT=plan.scale_after_dot, PER_ELEMENT=plan.per_element, OFFSET=offset, OFFSET_BITS=offset_bits,
        EMULATE_DOT_FP32=interpreting() and x.dtype == torch.bfloat16,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, GROUP_M=8, num_warps=plan.num_warps,
        num_stages=plan.num_stages)


def _launch_w4_swapped_gemm(x, qweight, scales, mins, launch: _SplitLaunch, group_k: int, plan: TilePlan):
    (M, K), N = x.shape, qweight.shape[0]
    offset, offset_bits = _offset_bits(x.dtype, quant_gemm.KIND_INT4)
    grid = (triton.cdiv(M, plan.block_m) * triton.cdiv(N, plan.block_n), plan.num_splits)
    quant_gemm_swapped._w4_swapped_gemm_kernel[grid](
        x, qweight, scales, scales if mins is None else mins, launch.target, launch.out, launch.locks, M, N, K,
        plan.num_k_steps, plan.num_splits, x.stride(0), qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), launch.out.stride(0), launch.split_stride(),
        REDUCE_SPLITS=launch.reduce_in_kernel, GROUP_K=group_k, HAS_MINS=mins is not None, OFFSET=offset,
        OFFSET_BITS=offset_bits, EMULATE_DOT_FP32=interpreting() and x.dtype == torch.bfloat16,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, num_warps=plan.num_warps,
        num_stages=plan.num_stages)


def dequantize_int_weight(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, kind: int,
                          group_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The "int" weight [N, K] in dtype (quant_dequant.py): a fresh tensor from the caching allocator, so that a
    CUDA graph capture takes it from its pool and nothing syncs with the host."""
    N = qweight.shape[0]
    K = qweight.shape[1] * (8 if kind == quant_gemm.KIND_INT4 else 1)
    out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    block_n, block_k = 32, 256  # a row's words: 128 bytes (4-bit), 256 bytes (8-bit)
    quant_dequant._dequant_int_kernel[(triton.cdiv(N, block_n), triton.cdiv(K, block_k))](
        qweight, scales, scales if mins is None else mins, out, N, K, qweight.stride(0), scales.stride(0),
        0 if mins is None else mins.stride(0), out.stride(0), WEIGHT_KIND=kind, GROUP_K=group_k,
        HAS_MINS=mins is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    """x as [M, K] with unit column stride (a view when it already is one)."""
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} input features but the weight has K={K}")
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_int_args(x, qweight, scales, mins, bits: int, group_size: int) -> int:
    """K of the weight; ValueError naming the first argument that breaks the layout contract."""
    if bits == 4:
        if qweight.dtype != torch.int32:
            raise ValueError(f"bits=4 needs qweight int32 [N, K // 8], got {qweight.dtype}")
        K = qweight.shape[1] * 8
    elif bits == 8:
        if qweight.dtype != torch.int8:
            raise ValueError(f"bits=8 needs qweight int8 [N, K], got {qweight.dtype}")
        K = qweight.shape[1]
    else:
        raise ValueError(f"bits={bits} is not supported; int_linear takes 4 or 8")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    if group_size <= 0 or K % group_size or (bits == 4 and group_size % 8):
        raise ValueError(f"group_size={group_size} must divide K={K} (and be a multiple of 8 for 4 bits)")
    expected = (qweight.shape[0], K // group_size)
    for name, t in (("scales", scales), ("mins", mins)):
        if t is not None and tuple(t.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [N, K // group_size] = {list(expected)}")
    return K


@torch.library.custom_op("nanovllm::int_linear", mutates_args=())
def _int_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   mins: typing.Optional[torch.Tensor],  # noqa: UP045 -- what every torch schema inference reads
                   bits: int, group_size: int) -> torch.Tensor:
    kind = quant_gemm.KIND_INT4 if bits == 4 else quant_gemm.KIND_INT8
    scales, mins = scales.contiguous(), None if mins is None else mins.contiguous()
    if x.shape[0] >= DEQUANT_GEMM_MIN_ROWS[kind]:
        return _dequantize_then_mm(x, qweight, scales, mins, kind, group_size)
    return weight_only_linear(x, qweight, scales, mins, kind, 1, group_size)


# The large-M "int" path's dequantized-weight scratch, in bytes: None (no bound) dequantizes a whole weight in one
# pass; a bound makes it dequantize row chunks of at most that many bytes, each multiplied before the next is made.
# The scratch sits at the peak of the activation profile and of every piecewise graph pool, so inside a small budget
# (8 GiB) a whole gate_up's bf16 copy (192 MiB on Qwen3-8B) is KV lost; on a large GPU chunks only cost time (each
# chunk's GEMM is narrower). The engine sets it once at start-up from its memory budget
# (memory_profile.bound_dequant_scratch); set_dequant_scratch_max_bytes is the only writer.
_dequant_scratch_max_bytes: int | None = None


def set_dequant_scratch_max_bytes(max_bytes: int | None):
    """Bound the large-M dequantization's scratch (None: a whole weight at once). At least 128 rows are
    dequantized at a time whatever the bound."""
    global _dequant_scratch_max_bytes
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes={max_bytes} must be >= 0 (or None for no bound)")
    _dequant_scratch_max_bytes = max_bytes


def dequant_chunk_rows(N: int, K: int, element_size: int) -> int:
    """Rows of an [N, K] weight dequantized at a time under the scratch bound: N (one pass) when the whole copy
    fits or nothing bounds it, else the most multiple of 128 rows that fit (at least 128)."""
    max_bytes = _dequant_scratch_max_bytes
    if max_bytes is None or N * K * element_size <= max_bytes:
        return N
    return min(N, max(128, max_bytes // (K * element_size) // 128 * 128))


def _dequantize_then_mm(x, qweight, scales, mins, kind: int, group_size: int) -> torch.Tensor:
    """x @ dequant(W).T through cuBLAS: the weight dequantized whole, or in row chunks of at most
    _dequant_scratch_max_bytes, each chunk's product written into its columns of the output (a strided view cuBLAS
    writes in place)."""
    (M, K), N = x.shape, qweight.shape[0]
    chunk_rows = dequant_chunk_rows(N, K, x.element_size())
    if chunk_rows >= N:
        return F.linear(x, dequantize_int_weight(qweight, scales, mins, kind, group_size, x.dtype))
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    for n0 in range(0, N, chunk_rows):
        rows = slice(n0, min(N, n0 + chunk_rows))
        w = dequantize_int_weight(qweight[rows], scales[rows], None if mins is None else mins[rows], kind,
                                  group_size, x.dtype)
        torch.mm(x, w.t(), out=out[:, rows])
        del w  # freed before the next chunk is made: the scratch never holds two chunks
    return out


@_int_linear_op.register_fake
def _(x, qweight, scales, mins, bits, group_size):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
               bits: int, group_size: int) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(qweight).T in x.dtype, for the "int" kind (module docstring)."""
    K = _check_int_args(x, qweight, scales, mins, bits, group_size)
    _check_device(x, "int_linear")
    x2 = _rows(x, K)
    return _int_linear_op(x2, qweight, scales, mins, bits, group_size).view(*x.shape[:-1], qweight.shape[0])


def _w8a8_applies(x: torch.Tensor, K: int, group_k: int) -> bool:
    """Large M on sm_89+, with scale blocks along K that one dot step can take (a power of two, 16..256)."""
    if x.shape[0] < FP8_ACT_QUANT_MIN_ROWS or not _has_fp8_tensor_cores(x.device):
        return False
    return group_k >= K or (16 <= group_k <= 256 and group_k & (group_k - 1) == 0)


@torch.library.custom_op("nanovllm::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_n: int,
                   block_k: int) -> torch.Tensor:
    K = x.shape[1]
    scales = scales.contiguous()
    if _w8a8_applies(x, K, block_k):
        return fp8_w8a8_linear(x, qweight, scales, block_n, min(block_k, K))
    return weight_only_linear(x, qweight, scales, None, quant_gemm.KIND_FP8, block_n, block_k)


@_fp8_linear_op.register_fake
def _(x, qweight, scales, block_n, block_k):
    return x.new_empty((x.shape[0], qweight.shape[0]))


def _check_fp8_args(x, qweight, scales, block_n: int, block_k: int):
    if qweight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear needs qweight float8_e4m3fn [N, K], got {qweight.dtype}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    N, K = qweight.shape
    if block_n <= 0 or block_k <= 0:
        raise ValueError(f"block_size=({block_n}, {block_k}) must be positive")
    expected = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected:
        raise ValueError(f"scales must be float32 [ceil(N / bn), ceil(K / bk)] = {list(expected)} for "
                         f"block_size=({block_n}, {block_k}), got {scales.dtype} {list(scales.shape)}")


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_size) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(qweight).T in x.dtype for the "fp8" kind, block_size = (bn, bk):
    (128, 128) blocks, (1, K) per-channel, (N, K) per-tensor (module docstring)."""
    block_n, block_k = (int(b) for b in block_size)
    _check_fp8_args(x, qweight, scales, block_n, block_k)
    _check_device(x, "fp8_linear")
    N, K = qweight.shape
    return _fp8_linear_op(_rows(x, K), qweight, scales, block_n, block_k).view(*x.shape[:-1], N)
