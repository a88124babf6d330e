"""The paged KV cache's store: one program per new token copies its K and V rows (all kv heads) to their slot, as
they are or as FP8 values and per-token scales; slot -1 (CUDA-graph padding) is skipped. The cache layout is in
paged_common.py."""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged_common import check_cache, quantize_fp8_rows, scale_args


@triton.jit
def _store_row(x, cache_ptr, scale_ptr, blk, off, offs_h, offs_d, h_mask, mask,
               stride_cb, stride_ct, stride_ch, stride_sb, stride_st, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """Store one token's head rows x [BLOCK_H, BLOCK_D] at (blk, off): as they are, or as FP8 values + scales."""
    dst = cache_ptr + blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    if FP8:
        values, scale = quantize_fp8_rows(x.to(tl.float32), FP8_MAX, cache_ptr.dtype.element_ty)
        tl.store(dst, values, mask=mask)
        tl.store(scale_ptr + blk * stride_sb + off * stride_st + offs_h, scale, mask=h_mask)
    else:
        tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    stride_sb, stride_st,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < NUM_HEADS
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_D]
    t64 = t.to(tl.int64)

    k = tl.load(key_ptr + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask,
                other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask,
                other=0.0)
    _store_row(k, k_cache_ptr, k_scale_ptr, blk, off, offs_h, offs_d, h_mask, mask,
               stride_kcb, stride_kct, stride_kch, stride_sb, stride_st, FP8, FP8_MAX)
    _store_row(v, v_cache_ptr, v_scale_ptr, blk, off, offs_h, offs_d, h_mask, mask,
               stride_vcb, stride_vct, stride_vch, stride_sb, stride_st, FP8, FP8_MAX)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] to their slots; slot -1 is skipped. With FP8 caches
    each token's head vectors are quantized and their scales written to k_scale / v_scale."""
    num_tokens, num_heads, head_dim = key.shape
    check_cache(k_cache, v_cache, num_heads, head_dim)
    assert value.shape == key.shape and slot_mapping.shape[0] == num_tokens
    if num_tokens == 0:
        return
    fp8 = k_scale is not None
    k_scale, v_scale, scale_strides = scale_args(k_cache, k_scale, v_scale)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        *key.stride(), *value.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *scale_strides,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0, num_warps=4,
    )

