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
With `residual` (a row-parallel layer's residual stream) both add their product into it in place: the weight-only
kernels in their epilogue, in fp32 with one rounding (quant_gemm.py's ADD_OUT), the large-M GEMMs by an add after.
Both functions are torch custom ops (`torch.ops.nanovllm.int_linear`, `.fp8_linear`, and `.int_linear_add_`,
`.fp8_linear_add_` with a residual, which mutate it and return nothing): torch.compile treats them as opaque calls,
and CUDA graphs capture them (no host sync; the split-K partials come from the caching allocator).
On CPU tensors they run only under Triton's interpreter (TRITON_INTERPRET=1, the tests); the engine's CPU path
dequantizes and calls F.linear.
"""
import typing

import torch
import torch.nn.functional as F
import triton

from nanovllm.kernels import quant_dequant, quant_gemm
from nanovllm.kernels.quant_launch import SplitLaunch, launch_weight_only
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
                       plan: TilePlan | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (16-bit, unit column stride) @ dequant(qweight).T -> [M, N] in x.dtype (quant_gemm.py). With
    residual ([M, N], x's dtype, contiguous): residual + the product, added in fp32 and rounded once by the kernel
    (ADD_OUT), written into residual, which is returned."""
    M, N = x.shape[0], qweight.shape[0]
    if residual is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    else:
        _check_residual(residual, x, N)
        out = residual
    if M > 0:
        _write_weight_only(x, qweight, scales, mins, kind, group_n, group_k, plan, out, residual is not None)
    return out


def _write_weight_only(x, qweight, scales, mins, kind: int, group_n: int, group_k: int, plan: TilePlan | None,
                       out: torch.Tensor, add_out: bool):
    """The product written into out ([M, N], contiguous; any float dtype, the tests read the kernels' fp32 result
    this way), added to out's old values when add_out."""
    (M, K), N = x.shape, qweight.shape[0]
    plan = plan or plan_weight_only(M, N, K, group_k, device_limits(x.device), kind, group_n, mins is not None)
    split = plan.num_splits > 1
    target = torch.empty((plan.num_splits, M, N), dtype=torch.float32, device=x.device) if split else out
    num_tiles = triton.cdiv(N, plan.block_n) * (1 if plan.cuda_cores else triton.cdiv(M, plan.block_m))
    locks = _split_lock_tensor(x.device, num_tiles) if split else None
    launch = SplitLaunch(target, out, out if locks is None else locks, locks is not None, add_out)
    launch_weight_only(x, qweight, scales, mins, launch, kind, group_n, group_k, plan)
    if split and not launch.reduce_in_kernel:
        block = 1024
        quant_gemm._sum_splits_kernel[(triton.cdiv(M * N, block),)](target, out, M * N, plan.num_splits,
                                                                     ADD_OUT=add_out, BLOCK=block, num_warps=4)


def _check_residual(residual: torch.Tensor, x: torch.Tensor, N: int):
    """ValueError unless the product of x [..., K] can be added into residual in place: x's leading dimensions and
    N, x's dtype and device, contiguous (the kernels index the output as they index the split-K partials)."""
    expected = (*x.shape[:-1], N)
    if (tuple(residual.shape) != expected or residual.dtype != x.dtype or residual.device != x.device
            or not residual.is_contiguous()):
        raise ValueError(f"residual is {residual.dtype} {list(residual.shape)} on {residual.device} (contiguous: "
                         f"{residual.is_contiguous()}); the product adds into a contiguous {x.dtype} "
                         f"{list(expected)} on {x.device}")


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


def _int_linear(x, qweight, scales, mins, bits: int, group_size: int, residual: torch.Tensor | None):
    """The "int" ops' body: the weight-only kernels below DEQUANT_GEMM_MIN_ROWS rows, with residual adding into it
    in their epilogue; the dequantized weight and cuBLAS from there on, with residual a separate add."""
    kind = quant_gemm.KIND_INT4 if bits == 4 else quant_gemm.KIND_INT8
    scales, mins = scales.contiguous(), None if mins is None else mins.contiguous()
    if x.shape[0] < DEQUANT_GEMM_MIN_ROWS[kind]:
        return weight_only_linear(x, qweight, scales, mins, kind, 1, group_size, residual=residual)
    y = _dequantize_then_mm(x, qweight, scales, mins, kind, group_size)
    return y if residual is None else residual.add_(y)


@torch.library.custom_op("nanovllm::int_linear", mutates_args=())
def _int_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   mins: typing.Optional[torch.Tensor],  # noqa: UP045 -- what every torch schema inference reads
                   bits: int, group_size: int) -> torch.Tensor:
    return _int_linear(x, qweight, scales, mins, bits, group_size, None)


# residual += x @ dequant(W).T. It returns nothing: a custom op may not return an alias of an input
@torch.library.custom_op("nanovllm::int_linear_add_", mutates_args=("residual",))
def _int_linear_add_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       mins: typing.Optional[torch.Tensor],  # noqa: UP045 -- as _int_linear_op's
                       bits: int, group_size: int, residual: torch.Tensor) -> None:
    _int_linear(x, qweight, scales, mins, bits, group_size, residual)


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


@_int_linear_add_op.register_fake
def _(x, qweight, scales, mins, bits, group_size, residual):
    return None


def int_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
               bits: int, group_size: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(qweight).T in x.dtype, for the "int" kind (module docstring). With
    residual [..., N] (x's dtype, contiguous): y added into it in place (_residual_rows), and residual returned."""
    K = _check_int_args(x, qweight, scales, mins, bits, group_size)
    _check_device(x, "int_linear")
    x2, N = _rows(x, K), qweight.shape[0]
    if residual is None:
        return _int_linear_op(x2, qweight, scales, mins, bits, group_size).view(*x.shape[:-1], N)
    _int_linear_add_op(x2, qweight, scales, mins, bits, group_size, _residual_rows(residual, x, N))
    return residual


def _residual_rows(residual: torch.Tensor, x: torch.Tensor, N: int) -> torch.Tensor:
    """residual [..., N] as rows [M, N], a view (ValueError naming it unless it matches x [..., K]): the weight-only
    kernels add the product into it in their epilogue, rounding once (quant_gemm.py's ADD_OUT)."""
    _check_residual(residual, x, N)
    return residual.view(-1, N)


def _w8a8_applies(x: torch.Tensor, K: int, group_k: int) -> bool:
    """Large M on sm_89+, with scale blocks along K that one dot step can take (a power of two, 16..256)."""
    if x.shape[0] < FP8_ACT_QUANT_MIN_ROWS or not _has_fp8_tensor_cores(x.device):
        return False
    return group_k >= K or (16 <= group_k <= 256 and group_k & (group_k - 1) == 0)


def _fp8_linear(x, qweight, scales, block_n: int, block_k: int, residual: torch.Tensor | None):
    """The "fp8" ops' body: the FP8 GEMM from FP8_ACT_QUANT_MIN_ROWS on (with residual a separate add), else the
    weight-only kernels (with residual adding into it in their epilogue)."""
    K = x.shape[1]
    scales = scales.contiguous()
    if _w8a8_applies(x, K, block_k):
        y = fp8_w8a8_linear(x, qweight, scales, block_n, min(block_k, K))
        return y if residual is None else residual.add_(y)
    return weight_only_linear(x, qweight, scales, None, quant_gemm.KIND_FP8, block_n, block_k, residual=residual)


@torch.library.custom_op("nanovllm::fp8_linear", mutates_args=())
def _fp8_linear_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_n: int,
                   block_k: int) -> torch.Tensor:
    return _fp8_linear(x, qweight, scales, block_n, block_k, None)


@torch.library.custom_op("nanovllm::fp8_linear_add_", mutates_args=("residual",))
def _fp8_linear_add_op(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int,
                       residual: torch.Tensor) -> None:
    _fp8_linear(x, qweight, scales, block_n, block_k, residual)


@_fp8_linear_op.register_fake
def _(x, qweight, scales, block_n, block_k):
    return x.new_empty((x.shape[0], qweight.shape[0]))


@_fp8_linear_add_op.register_fake
def _(x, qweight, scales, block_n, block_k, residual):
    return None


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


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block_size,
               residual: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(qweight).T in x.dtype for the "fp8" kind, block_size = (bn, bk):
    (128, 128) blocks, (1, K) per-channel, (N, K) per-tensor (module docstring). With residual: as int_linear's."""
    block_n, block_k = (int(b) for b in block_size)
    _check_fp8_args(x, qweight, scales, block_n, block_k)
    _check_device(x, "fp8_linear")
    N, K = qweight.shape
    if residual is None:
        return _fp8_linear_op(_rows(x, K), qweight, scales, block_n, block_k).view(*x.shape[:-1], N)
    _fp8_linear_add_op(_rows(x, K), qweight, scales, block_n, block_k, _residual_rows(residual, x, N))
    return residual
