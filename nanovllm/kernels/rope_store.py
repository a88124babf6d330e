"""One Triton kernel for what each layer does between the qkv projection and attention: (Qwen3's per-head RMSNorm
of q and k,) NeoX rope of q and k, and the store of k and v at their cache slots.

The unfused path is a compiled norm + rope (one or two kernels) plus the store kernel; in a decode step each of
those is a few microseconds of mostly launch and latency, 28-36 times per step. One program per token reads its
q, k, v row from the qkv output once, writes the roped q, and writes k and v straight into the paged cache.

Rounding follows the torch path step by step (normalize in fp32, round to the model dtype, multiply by the
weight and round, rope in fp32, round); tests/test_rope_store_kernel.py compares the two.
Used with the Triton and flash backends whenever head_dim / 2 is a power of two (measured: docs/benchmarks.md).
"""
import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged_common import quantize_fp8_rows


@triton.jit
def _norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """x1, x2: [BLOCK_H, HALF] fp32 halves of the head vectors; returns the roped halves (fp32, dtype-rounded)."""
    if NORM:
        ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM  # [BLOCK_H]
        rstd = 1.0 / tl.sqrt(ms + eps)
        x1 = (x1 * rstd[:, None]).to(OUT_DTYPE).to(tl.float32)
        x2 = (x2 * rstd[:, None]).to(OUT_DTYPE).to(tl.float32)
        x1 = (x1 * w1[None, :]).to(OUT_DTYPE).to(tl.float32)
        x2 = (x2 * w2[None, :]).to(OUT_DTYPE).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :]


@triton.jit
def _load_norm_rope(src, mask, weight_ptr, cos, sin, eps, offs, HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
                    NORM: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """Load head rows [BLOCK, HEAD_DIM] at src as two fp32 halves, (norm with weight_ptr,) rope them."""
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    w1 = cos  # placeholders, unused without NORM
    w2 = sin
    if NORM:
        w1 = tl.load(weight_ptr + offs).to(tl.float32)
        w2 = tl.load(weight_ptr + HALF + offs).to(tl.float32)
    return _norm_rope(x1, x2, w1, w2, cos, sin, eps, HEAD_DIM, NORM, OUT_DTYPE)


@triton.jit
def _rotate(x1, x2, rot_ptr, offs, HALF: tl.constexpr, HEAD_DIM: tl.constexpr, EXACT: tl.constexpr):
    """[x1 x2] @ H for halves x1, x2 [R, HALF] fp32 (R >= 16 for tl.dot), H [HEAD_DIM, HEAD_DIM] fp32 at rot_ptr.
    EXACT (fp32 models): IEEE fp32 products; otherwise tf32, whose rounding is far below the FP8 values' and the
    model dtype's."""
    cols = tl.arange(0, HEAD_DIM)
    top = tl.load(rot_ptr + offs[:, None] * HEAD_DIM + cols[None, :])  # [HALF, HEAD_DIM]
    bottom = tl.load(rot_ptr + (HALF + offs[:, None]) * HEAD_DIM + cols[None, :])
    if EXACT:
        return tl.dot(x1, top, input_precision="ieee") + tl.dot(x2, bottom, input_precision="ieee")
    return tl.dot(x1, top) + tl.dot(x2, bottom)  # [R, HEAD_DIM] fp32


@triton.jit
def _rope_store_fp8(row, k1, k2, rot_ptr, blk, off, offs, offs_kh, kmask,
                    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sb, stride_st,
                    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HALF: tl.constexpr, FP8_MAX: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """An FP8 cache: k (roped, rounded to the model dtype as the unfused path has it) rotated, then k and v
    quantized with one scale per kv head."""
    h_mask = offs_kh < NUM_KV_HEADS
    cols = tl.arange(0, HEAD_DIM)
    full_mask = h_mask[:, None] & (cols < HEAD_DIM)[None, :]
    k = _rotate(k1.to(OUT_DTYPE).to(tl.float32), k2.to(OUT_DTYPE).to(tl.float32), rot_ptr, offs, HALF, HEAD_DIM,
                OUT_DTYPE == tl.float32)
    values, scale = quantize_fp8_rows(k, FP8_MAX, k_cache_ptr.dtype.element_ty)
    tl.store(k_cache_ptr + blk * stride_kcb + off * stride_kct + offs_kh[:, None] * stride_kch + cols[None, :],
             values, mask=full_mask)
    tl.store(k_scale_ptr + blk * stride_sb + off * stride_st + offs_kh, scale, mask=h_mask)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + offs_kh[:, None]) * HEAD_DIM + cols[None, :], mask=full_mask,
                other=0.0).to(tl.float32)
    values, scale = quantize_fp8_rows(v, FP8_MAX, v_cache_ptr.dtype.element_ty)
    tl.store(v_cache_ptr + blk * stride_vcb + off * stride_vct + offs_kh[:, None] * stride_vch + cols[None, :],
             values, mask=full_mask)
    tl.store(v_scale_ptr + blk * stride_sb + off * stride_st + offs_kh, scale, mask=h_mask)


@triton.jit
def _rope_store_kernel(
    qkv_ptr, positions_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr, slot_mapping_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, rot_ptr, eps,
    stride_qkv_t, stride_cs, stride_qt, stride_qh,
    stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sb, stride_st,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs)
    out_dtype = q_out_ptr.dtype.element_ty
    row = qkv_ptr + t * stride_qkv_t

    # q: heads [0, NUM_HEADS) of the row
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None]
    y1, y2 = _load_norm_rope(row + offs_h[:, None] * HEAD_DIM + offs[None, :], mask, q_weight_ptr, cos, sin, eps,
                             offs, HALF, HEAD_DIM, NORM, out_dtype)
    if FP8:  # q rotated like the cached K, from q as the unfused path rounds it
        y = _rotate(y1.to(out_dtype).to(tl.float32), y2.to(out_dtype).to(tl.float32), rot_ptr, offs, HALF, HEAD_DIM,
                    out_dtype == tl.float32)
        cols = tl.arange(0, HEAD_DIM)
        tl.store(q_out_ptr + t * stride_qt + offs_h[:, None] * stride_qh + cols[None, :], y.to(out_dtype),
                 mask=mask & (cols < HEAD_DIM)[None, :])
    else:
        dst = q_out_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs[None, :]
        tl.store(dst, y1.to(out_dtype), mask=mask)
        tl.store(dst + HALF, y2.to(out_dtype), mask=mask)

    # k and v: the next 2 * NUM_KV_HEADS heads, to the cache (slot -1: CUDA-graph padding, nothing to store)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        offs_kh = tl.arange(0, BLOCK_KH)
        kmask = (offs_kh < NUM_KV_HEADS)[:, None]
        # names differ from q's above: Triton wants a value's shape to stay the same across an `if`
        k1, k2 = _load_norm_rope(row + (NUM_HEADS + offs_kh[:, None]) * HEAD_DIM + offs[None, :], kmask,
                                 k_weight_ptr, cos, sin, eps, offs, HALF, HEAD_DIM, NORM, out_dtype)
        if FP8:
            _rope_store_fp8(row, k1, k2, rot_ptr, blk, off, offs, offs_kh, kmask,
                            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                            stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, stride_sb,
                            stride_st, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HALF, FP8_MAX, out_dtype)
        else:
            cache_dtype = k_cache_ptr.dtype.element_ty
            k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kct + offs_kh[:, None] * stride_kch + offs[None, :]
            tl.store(k_dst, k1.to(cache_dtype), mask=kmask)
            tl.store(k_dst + HALF, k2.to(cache_dtype), mask=kmask)
            v_src = row + (NUM_HEADS + NUM_KV_HEADS + offs_kh[:, None]) * HEAD_DIM + offs[None, :]
            v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vct + offs_kh[:, None] * stride_vch + offs[None, :]
            tl.store(v_dst, tl.load(v_src, mask=kmask, other=0.0).to(cache_dtype), mask=kmask)
            tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=kmask, other=0.0).to(cache_dtype), mask=kmask)

def rope_store_kvcache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                       k_weight: torch.Tensor | None = None, eps: float = 1e-6, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, rotation: torch.Tensor | None = None) -> torch.Tensor:
    """qkv [T, (num_heads + 2 * num_kv_heads) * head_dim] -> roped q [T, num_heads, head_dim]; the roped k and
    v go to their slots in k_cache / v_cache ([num_blocks, block_size, num_kv_heads, head_dim] views).
    With q_weight and k_weight, q and k get a per-head RMSNorm first (Qwen3). With an FP8 cache (scales
    `k_scale` / `v_scale` [num_blocks, block_size, num_kv_heads]), `rotation` is the layout's Hadamard matrix
    [head_dim, head_dim] fp32: q comes back rotated and k is rotated before it is quantized."""
    num_tokens = qkv.shape[0]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert head_dim % 2 == 0 and (head_dim // 2) & (head_dim // 2 - 1) == 0, "head_dim / 2 must be a power of two"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and cos_sin_cache.stride(1) == 1
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    norm, fp8 = q_weight is not None, k_scale is not None
    assert fp8 == (rotation is not None), "an FP8 cache needs its rotation, and only an FP8 cache has one"
    min_rows = 16 if fp8 else 1  # the rotation is a tl.dot, which needs 16 rows
    _rope_store_kernel[(num_tokens,)](
        qkv, positions, cos_sin_cache, q_weight if norm else qkv, k_weight if norm else qkv, slot_mapping,
        q, k_cache, v_cache, k_scale if fp8 else k_cache, v_scale if fp8 else v_cache,
        rotation if fp8 else qkv, eps,
        qkv.stride(0), cos_sin_cache.stride(0), q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *(k_scale.stride()[:2] if fp8 else (0, 0)),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=max(min_rows, triton.next_power_of_2(num_heads)),
        BLOCK_KH=max(min_rows, triton.next_power_of_2(num_kv_heads)),
        HALF=head_dim // 2, NORM=norm, FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0, num_warps=4,
    )
    return q
