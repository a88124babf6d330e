"""What the paged-attention kernels share: the cache layout's row addressing, one online-softmax tile step, the
FP8 helpers, the tile config and the checks of the cache views.

KV cache layout
---------------
The whole cache is one tensor ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
A layer sees the views ``k_cache = kv[:, layer, 0]`` and ``v_cache = kv[:, layer, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``: the inner ``[block_size, H, D]`` is contiguous,
the block stride is ``num_layers * 2 * block_size * H * D``. Kernels take every stride from the
tensors (only ``head_dim`` must have stride 1). Token ``t`` of a sequence lives in the physical block
``block_tables[seq, t // block_size]`` at row ``t % block_size``; a slot id is
``block_id * block_size + offset``. With an FP8 cache each token has one scale per kv head,
``[num_blocks, block_size, num_kv_heads]``.

All softmax math is fp32 in the log2 domain (``exp2`` with ``scale * log2(e)``).
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs

from nanovllm.utils.switches import SWITCHES

LOG2E = 1.4426950408889634


@triton.jit
def cache_rows(bt_row_ptr, n_start, pos, pos_mask, stride_b, stride_t,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets (int64) of the cache rows holding token positions ``pos`` [BLOCK_N]."""
    if BLOCK_SIZE >= BLOCK_N:
        # the key tile lies inside one cache block (n_start is a multiple of BLOCK_N)
        blk = tl.load(bt_row_ptr + n_start // BLOCK_SIZE).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    return blk * stride_b + (pos % BLOCK_SIZE) * stride_t  # [BLOCK_N]


@triton.jit
def attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row_ptr, n_start, q_pos, kv_end,
                stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, FP8: tl.constexpr):
    """One online-softmax step of the query rows ``q`` [M, BLOCK_D] over keys [n_start, n_start+BLOCK_N).

    MASK: keys >= kv_end are invalid (last tile); CAUSAL: row r only sees keys <= q_pos[r].
    FP8: K/V are FP8 with one scale per token (``ks_head``/``vs_head``, strides ``stride_sb``/``stride_st``): the
    values go through the dot in q's dtype and the scales are applied to its result (K: per key column of the
    scores; V: per key column of p), so no dequantized tile is materialised.
    One piece: a kernel's inner loop body, where each load, dot and rescale feeds the next in registers; the
    MASK / CAUSAL / FP8 variants are compile-time branches of the same step, not separate jobs.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = n_start + offs_n  # [BLOCK_N]
    if MASK:
        n_mask = pos < kv_end
    else:
        n_mask = pos >= 0  # all true
    k_rows = cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
    v_rows = cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N)
    if BLOCK_D == HEAD_DIM:
        kv_mask = n_mask[:, None]
    else:
        kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    if MASK:
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    elif BLOCK_D == HEAD_DIM:
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :])
    else:
        k = tl.load(k_head + k_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)

    if FP8:  # q is fp32 or, for half-precision models, fp16 (fp16_query)
        s_rows = cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_sb, stride_st, BLOCK_SIZE, BLOCK_N)
        k_scale = tl.load(ks_head + s_rows, mask=n_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
        k = k.to(q.dtype)  # exact: every FP8 value is an fp16 value
    if q.dtype == tl.float32:  # full fp32 for the float32 parity tests (tl.dot would round to tf32)
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [M, BLOCK_N] fp32, log2 domain
    else:
        qk = tl.dot(q, tl.trans(k)) * qk_scale
    if FP8:
        qk = qk * k_scale[None, :]
    if CAUSAL:
        qk = tl.where(pos[None, :] <= q_pos[:, None], qk, float("-inf"))
    elif MASK:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(qk, 1))  # [M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])  # [M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)

    if MASK:
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    elif BLOCK_D == HEAD_DIM:
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :])
    else:
        v = tl.load(v_head + v_rows[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    pv = p
    if FP8:
        v_scale = tl.load(vs_head + s_rows, mask=n_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
        v = v.to(q.dtype)
        if q.dtype == tl.float32:
            pv = p * v_scale[None, :]
        else:  # p times the scales relative to the tile's largest (powers of two: exact), in [0, 1] for fp16
            v_max = tl.maximum(tl.max(v_scale, 0), 1e-30)
            pv = p * (v_scale / v_max)[None, :]
    if q.dtype == tl.float32:
        acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision="ieee")  # [M, BLOCK_D]
    elif FP8:
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v) * v_max
    else:
        acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v)
    return acc, m_new, l_i


@triton.jit
def attend_tile_fp8_halves(accT_lo, accT_hi, m_i, l_i, v_unit, qT_lo, qT_hi, k_head, v_head, ks_head, vs_head,
                           bt_row_ptr, n_start, kv_end, stride_kb, stride_kt, stride_vb, stride_vt, stride_sb,
                           stride_st, qk_scale,
                           BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr):
    """attend_tile's decode step over an FP8 cache with q in fp16 (fp16_query), transposed and in head_dim halves:
    scores^T = K q^T [BLOCK_N, G] and out^T += V^T p^T [HALF_D, G], where G is the group's query heads. Transposed,
    the query heads are the dots' narrow dimension, which the tensor cores pad to 8 rather than to 16 as rows, so
    the accumulators, q and the scores take half the registers, and a program needs fewer of them: more programs
    fit an SM. Same math and masks as attend_tile (MASK on).

    V is read as int16 byte pairs (two channels of one token) and converted in registers (_fp8_pairs_to_fp16):
    the tile then reaches the dot as fp16, which Triton stages in shared memory and reads with ldmatrix, where an
    8-bit tile for a dot that reduces over tokens is gathered byte by byte.

    The accumulators are kept in units of `v_unit`, the largest V scale of the last tile (a power of two, > 0): p
    times each token's scale over the tile's largest is in [0, 1] for the fp16 dot, and moving the accumulators to
    the new tile's unit is an exact power-of-two factor folded into the softmax rescale, so the dots accumulate in
    place (one multiply per accumulator element, none where neither the row maxima nor the unit changed). The
    caller multiplies the result by the final `v_unit`."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF_D)
    offs_pair = tl.arange(0, HALF_D // 2)
    pos = n_start + offs_n  # [BLOCK_N]
    n_mask = pos < kv_end
    k_rows = cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
    v_rows = cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N)
    s_rows = cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_sb, stride_st, BLOCK_SIZE, BLOCK_N)
    k_half = k_head + k_rows[:, None] + offs_h[None, :]  # [BLOCK_N, HALF_D] pointers of the first half
    sT = tl.dot(tl.load(k_half, mask=n_mask[:, None], other=0.0).to(tl.float16), qT_lo)  # [BLOCK_N, G]
    sT = tl.dot(tl.load(k_half + HALF_D, mask=n_mask[:, None], other=0.0).to(tl.float16), qT_hi, sT)
    k_scale = tl.load(ks_head + s_rows, mask=n_mask, other=0.0).to(tl.float32) * qk_scale  # [BLOCK_N]
    sT = tl.where(n_mask[:, None], sT * k_scale[:, None], float("-inf"))  # log2 domain
    m_new = tl.maximum(m_i, tl.max(sT, 0))  # [G]
    alpha = tl.exp2(m_i - m_new)
    pT = tl.exp2(sT - m_new[None, :])
    l_i = l_i * alpha + tl.sum(pT, 0)
    v_scale = tl.load(vs_head + s_rows, mask=n_mask, other=0.0).to(tl.float32)  # [BLOCK_N]
    v_max = tl.maximum(tl.max(v_scale, 0), 1e-30)  # the tile's unit: p * v_scale / v_max fits fp16
    pvT = (pT * (v_scale / v_max)[:, None]).to(tl.float16)  # [BLOCK_N, G]
    rescale = alpha * (v_unit / v_max)  # [G], exact up to alpha's rounding
    if (tl.min(rescale, 0) != 1.0) | (tl.max(rescale, 0) != 1.0):
        accT_lo = accT_lo * rescale[None, :]
        accT_hi = accT_hi * rescale[None, :]
    e5m2: tl.constexpr = v_head.dtype.element_ty == tl.float8e5
    v_pairs = v_head.to(tl.pointer_type(tl.int16)) + ((v_rows // 2)[:, None] + offs_pair[None, :])
    v_lo = _fp8_pairs_to_fp16(tl.load(v_pairs, mask=n_mask[:, None], other=0), e5m2, BLOCK_N, HALF_D)
    v_hi = _fp8_pairs_to_fp16(tl.load(v_pairs + HALF_D // 2, mask=n_mask[:, None], other=0), e5m2, BLOCK_N, HALF_D)
    accT_lo = tl.dot(tl.trans(v_lo), pvT, accT_lo)
    accT_hi = tl.dot(tl.trans(v_hi), pvT, accT_hi)
    return accT_lo, accT_hi, m_new, l_i, v_max


# e4m3 byte pairs become fp16 pairs in one PTX instruction on a GPU; Triton's interpreter runs no PTX, so there the
# same values are converted a byte at a time
_E4M3_PAIRS_BY_PTX = tl.constexpr(not knobs.runtime.interpret)


@triton.jit
def _fp8_pairs_to_fp16(pairs, E5M2: tl.constexpr, BLOCK_N: tl.constexpr, HALF_D: tl.constexpr):
    """int16 [BLOCK_N, HALF_D // 2] of FP8 byte pairs (little-endian: the lower channel in the low byte) ->
    fp16 [BLOCK_N, HALF_D], exact (every e4m3 and e5m2 value is an fp16)."""
    if E5M2:  # an e5m2 value is the high byte of the same fp16
        lo = (pairs << 8).to(tl.float16, bitcast=True)
        hi = (pairs & -256).to(tl.float16, bitcast=True)
    elif _E4M3_PAIRS_BY_PTX:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; cvt.rn.f16x2.e4m3x2 t, $2; mov.b32 {$0, $1}, t; }",
            "=h,=h,h", [pairs], dtype=(tl.float16, tl.float16), is_pure=True, pack=1)
    else:
        lo = (pairs & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = ((pairs >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, HALF_D))


@triton.jit
def head_pointers(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kvh, stride_kh, stride_vh):
    """kv head `kvh`'s base pointers in the K and V caches and in their scales (a token's scales are
    [num_kv_heads], contiguous)."""
    return k_cache_ptr + kvh * stride_kh, v_cache_ptr + kvh * stride_vh, k_scale_ptr + kvh, v_scale_ptr + kvh


@triton.jit
def query_for_cache(q, qk_scale, FP8: tl.constexpr):
    """q and the softmax scale as the dots take them: against FP8 keys a half-precision q goes to fp16 (fp16_query);
    otherwise, and for the float32 parity path, unchanged."""
    if FP8:
        if q.dtype != tl.float32:
            q, qk_scale = fp16_query(q, qk_scale)
    return q, qk_scale


@triton.jit
def fp16_query(q, qk_scale):
    """q [M, D] for dots against FP8 keys and values: in fp16, because FP8 -> fp16 is one conversion instruction per
    two values and FP8 -> bf16 several (a bf16 dot left the FP8 decode kernel compute-bound at half the copy
    bandwidth). q is divided by a power of two that brings its largest entry to at most 2^14, so it fits fp16's
    range and a bf16 q converts exactly; the factor moves into qk_scale."""
    q32 = q.to(tl.float32)
    amax = tl.maximum(tl.max(tl.max(tl.abs(q32), 1), 0), 1e-30)
    ratio = tl.math.div_rn(amax, 16384.0).to(tl.int32, bitcast=True)
    factor = ((ratio + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)  # the next power of two, exact
    return tl.math.div_rn(q32, factor).to(tl.float16), qk_scale * factor


@triton.jit
def quantize_fp8_rows(x, FP8_MAX: tl.constexpr, FP8_DTYPE: tl.constexpr):
    """x [R, D] fp32 -> (FP8 values [R, D], bf16 scales [R]): one power-of-two scale per row, amax / FP8_MAX
    rounded up to a power of two; the same bytes as kv_layout.quantize_fp8 on every platform (see there)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)  # [R]
    ratio = tl.math.div_rn(amax, FP8_MAX).to(tl.int32, bitcast=True)  # IEEE division (Triton's `/` is not)
    scale = ((ratio + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)  # next power of two, exact
    values = tl.math.div_rn(x, scale[:, None])  # exact: a power of two
    values = tl.minimum(tl.maximum(values, -FP8_MAX), FP8_MAX).to(FP8_DTYPE)
    return values, scale.to(tl.bfloat16)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per program (prefill) — unused by decode
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # ptxas's per-thread cap (Triton's maxnreg): more programs per SM
    fp8_d_halves: bool = False  # FP8 decode: transposed, K and V in two head_dim halves (attend_tile_fp8_halves)

    def launch_options(self) -> dict:
        """The kernel launch's compile options."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options


def tile_from_env(name: str) -> "KernelConfig | None":
    """"block_m,block_n,num_warps,num_stages" from the environment variable `name` (side-by-side runs of bench.py)."""
    value = getattr(SWITCHES, name.removeprefix("NANOVLLM_").lower())  # read once at import (utils/switches.py)
    if not value:
        return None
    parts = value.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{name}={value!r}: expected four positive integers 'block_m,block_n,num_warps,num_stages', "
                         f"e.g. '64,64,4,3'; unset it for the default tile")
    return KernelConfig(*(int(p) for p in parts))


def scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """(k_scale, v_scale, (stride_block, stride_token)) for the kernels; without FP8 the cache stands in for the
    unused scale pointers, which FP8=False never reads."""
    if k_scale is None:
        return k_cache, k_cache, (0, 0)
    assert v_scale is not None and k_scale.shape == v_scale.shape == k_cache.shape[:3]
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1, "scales: [N, block_size, H], H contiguous"
    return k_scale, v_scale, k_scale.stride()[:2]


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "cache views must be [N, block_size, H, D]"
    assert k_cache.shape[2] == num_kv_heads and k_cache.shape[3] == head_dim
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
    bs = k_cache.shape[1]
    assert bs >= 1 and bs & (bs - 1) == 0, "block_size must be a power of two"


