"""Triton kernels for the paged KV cache: store, prefill attention, decode attention.

KV cache layout
---------------
The whole cache is one tensor ``kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.
A layer sees the views ``k_cache = kv[:, layer, 0]`` and ``v_cache = kv[:, layer, 1]``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``: the inner ``[block_size, H, D]`` is contiguous,
the block stride is ``num_layers * 2 * block_size * H * D``. Kernels take every stride from the
tensors (only ``head_dim`` must have stride 1). Token ``t`` of a sequence lives in the physical block
``block_tables[seq, t // block_size]`` at row ``t % block_size``; a slot id is
``block_id * block_size + offset``.

Kernels
-------
* ``_store_kvcache_kernel``: one program per new token copies its K and V rows (all kv heads) to
  their slot; slot -1 (CUDA-graph padding) is skipped.
* ``_prefill_kernel``: causal flash attention for a varlen batch whose K/V are all read from the
  paged cache (cached prefix + the tokens just stored). The query tile packs ``BLOCK_Q`` tokens x
  ``GROUP`` query heads of one kv head into ``BLOCK_M = BLOCK_Q * GROUP`` rows, so each K/V tile is
  loaded once per GQA group. The 1-D grid runs over the q tiles of all sequences (binary search in
  ``cu_seqlens_q``), heaviest tiles first; key tiles left of the diagonal skip the causal mask.
* ``_decode_kernel`` + ``_decode_reduce_kernel``: flash-decoding. Program ``(b, kv_head, split)``
  runs the ``GROUP`` query heads of one kv head (padded to 16 rows for ``tl.dot``) over one slice of
  the context and writes a partial output and its log-sum-exp; the reduce kernel merges the slices.
  The number of splits depends only on shapes (batch, kv heads, block-table width), never on
  ``seq_lens`` values, so the launch is CUDA-graph capturable. By default each row cuts its own length into
  that many slices in the kernel (``row_splits``; a graph's table is max_model_len wide, and cutting that
  width left a short row one live slice); slices past a sequence's end exit at once. With a single split
  the first kernel writes the output directly (no reduce launch). The launch order: a sequence's kv heads
  side by side in the grid (``KernelConfig.heads_fastest``, the default) and rows in a given order
  (``row_order``: the engine passes longest context first, so that no long row starts last and leaves the
  GPU to a few programs; on ragged contexts both together took 165 -> 146 us).

All softmax math is fp32 in the log2 domain (``exp2`` with ``scale * log2(e)``).
"""

import functools
import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from nanovllm.utils.switches import SWITCHES

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# shared device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _cache_rows(bt_row_ptr, n_start, pos, pos_mask, stride_b, stride_t,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Element offsets (int64) of the cache rows holding token positions ``pos`` [BLOCK_N]."""
    if BLOCK_SIZE >= BLOCK_N:
        # the key tile lies inside one cache block (n_start is a multiple of BLOCK_N)
        blk = tl.load(bt_row_ptr + n_start // BLOCK_SIZE).to(tl.int64)
    else:
        blk = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
    return blk * stride_b + (pos % BLOCK_SIZE) * stride_t  # [BLOCK_N]


@triton.jit
def _attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row_ptr, n_start, q_pos, kv_end,
                 stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, FP8: tl.constexpr):
    """One online-softmax step of the query rows ``q`` [M, BLOCK_D] over keys [n_start, n_start+BLOCK_N).

    MASK: keys >= kv_end are invalid (last tile); CAUSAL: row r only sees keys <= q_pos[r].
    FP8: K/V are FP8 with one scale per token (``ks_head``/``vs_head``, strides ``stride_sb``/``stride_st``): the
    values go through the dot in q's dtype and the scales are applied to its result (K: per key column of the
    scores; V: per key column of p), so no dequantized tile is materialised.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    pos = n_start + offs_n  # [BLOCK_N]
    if MASK:
        n_mask = pos < kv_end
    else:
        n_mask = pos >= 0  # all true
    k_rows = _cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_kb, stride_kt, BLOCK_SIZE, BLOCK_N)
    v_rows = _cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_vb, stride_vt, BLOCK_SIZE, BLOCK_N)
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
        s_rows = _cache_rows(bt_row_ptr, n_start, pos, n_mask, stride_sb, stride_st, BLOCK_SIZE, BLOCK_N)
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


# --------------------------------------------------------------------------------------------
# store_kvcache
# --------------------------------------------------------------------------------------------


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
    _check_cache(k_cache, v_cache, num_heads, head_dim)
    assert value.shape == key.shape and slot_mapping.shape[0] == num_tokens
    if num_tokens == 0:
        return
    fp8 = k_scale is not None
    k_scale, v_scale, scale_strides = _scale_args(k_cache, k_scale, v_scale)
    _store_kvcache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        *key.stride(), *value.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *scale_strides,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0, num_warps=4,
    )


# --------------------------------------------------------------------------------------------
# prefill attention
# --------------------------------------------------------------------------------------------


@triton.jit
def _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Sequence owning global q tile ``tile``; sequence i's tiles start at cu[i] // BLOCK_Q + i."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Triton compiles a variant per value class of each int argument (== 1, divisible by 16, other). num_seqs and the
# block-table width change from step to step, so without this every new class would JIT-compile mid-run.
@triton.jit(do_not_specialize=["num_seqs", "stride_btb"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    cu_seqlens_q_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale, num_seqs,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,
    stride_btb,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # last (heaviest) tiles are scheduled first
    kvh = tl.program_id(1)
    seq = _find_seq(cu_seqlens_q_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    q_tile = tile - (q_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # absolute position of the sequence's first query

    # rows: BLOCK_Q query tokens x GROUP heads sharing kv head `kvh`
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] query index within the sequence
    head = kvh * GROUP + offs_m % GROUP  # [BLOCK_M]
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = ctx_start + q_idx  # [BLOCK_M] absolute positions
    tok = (q_start + q_idx).to(tl.int64)
    q_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    if FP8:
        if q.dtype != tl.float32:
            q, qk_scale = fp16_query(q, qk_scale)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh
    ks_head = k_scale_ptr + kvh  # a token's scales are [num_kv_heads], contiguous
    vs_head = v_scale_ptr + kvh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    first_pos = ctx_start + q_tile * BLOCK_Q
    kv_end = ctx_start + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)  # one past the last visible key
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # key tiles below this are visible to every row
    for n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n, q_pos, kv_end,
                                     stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, False, FP8)
    for n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n, q_pos, kv_end,
                                     stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, True, FP8)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


@dataclass(frozen=True)
class KernelConfig:
    block_m: int  # query rows per program (prefill) — unused by decode
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    # decode: launch the grid with the kv heads of a sequence next to each other (program ids (kv_head, b)), so
    # programs running at the same time read neighbouring bytes of the same cache rows (a token's row holds every
    # kv head); the default order (b, kv_head) runs the same head of many sequences together. To be measured.
    heads_fastest: bool = False


def _tile_from_env(name: str) -> "KernelConfig | None":
    """"block_m,block_n,num_warps,num_stages" from the environment variable `name` (side-by-side runs of bench.py)."""
    value = getattr(SWITCHES, name.removeprefix("NANOVLLM_").lower())  # read once at import (utils/switches.py)
    if not value:
        return None
    parts = value.split(",")
    if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"{name}={value!r}: expected four positive integers 'block_m,block_n,num_warps,num_stages', "
                         f"e.g. '64,64,4,3'; unset it for the default tile")
    return KernelConfig(*(int(p) for p in parts))


_PREFILL_TILE = _tile_from_env("NANOVLLM_PREFILL_TILE")  # read once, like the module's other switches


def _prefill_config(dtype: torch.dtype, head_dim: int) -> KernelConfig:
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if _PREFILL_TILE is not None:
        return _PREFILL_TILE
    # H200 sweep, bf16 D=128, block size 64 (docs/benchmarks.md): (64, 64, 4, 3) against the old
    # (128, 64, 4, 3) is 1.23x faster on a bench.py prefill step (28 prompts of U[100, 1024], 16,384 tokens, Qwen3-8B
    # heads), 1.30x with Qwen3-0.6B heads, 1.21x on 29 x 560 tokens and 1.33x on 8 chunks of 1,000 after 2,000
    # cached tokens; the best of 12 tiles on the last, within 7% of the best on the others
    return KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                            max_query_len: int, scale: float, config: KernelConfig | None = None,
                            out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of new queries over their whole (paged) context. Returns [num_tokens, H, D] (`out` when
    given). With FP8 caches, `k_scale`/`v_scale` [num_blocks, block_size, num_kv_heads] hold each token's scales."""
    num_tokens, num_heads, head_dim = q.shape  # [T, H, D]
    num_kv_heads = k_cache.shape[2]
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [T, H, D]
    assert out.shape == (num_tokens, num_heads, head_dim)
    if num_tokens == 0 or num_seqs == 0:
        return out

    cfg = config or _prefill_config(q.dtype, head_dim)
    # small tiles when every query run is short (e.g. mostly-decode batches)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(max(1, max_query_len) * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    fp8 = k_scale is not None
    k_scale, v_scale, scale_strides = _scale_args(k_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, cu_seqlens_q, seq_lens, block_tables,
        scale * _LOG2E, num_seqs,
        *q.stride(), *out.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *scale_strides,
        block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
# decode attention (split-K / flash-decoding)
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["tokens_per_split", "num_splits", "stride_btb"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, seq_lens_ptr, block_tables_ptr, row_order_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, tokens_per_split, num_heads, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_ob, stride_oh, stride_od,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,
    stride_btb,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_FASTEST: tl.constexpr,
    ORDERED: tl.constexpr, ROW_SPLITS: tl.constexpr, FP8: tl.constexpr,
):
    if HEADS_FASTEST:
        kvh = tl.program_id(0)
        b = tl.program_id(1)
    else:
        b = tl.program_id(0)
        kvh = tl.program_id(1)
    if ORDERED:  # the grid's row index -> batch row (e.g. longest context first)
        b = tl.load(row_order_ptr + b)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if ROW_SPLITS:  # this row's own context in num_splits slices (tokens_per_split is unused)
        tokens_per_split = _row_split_tokens(seq_len, num_splits, BLOCK_N)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    if SPLIT:
        if start >= end:  # slice past the end of this sequence: the reduce ignores it
            return

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head = kvh * GROUP + offs_g  # [BLOCK_G] query heads of this kv head
    qo_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_G, BLOCK_D]
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=qo_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    if FP8:
        if q.dtype != tl.float32:
            q, qk_scale = fp16_query(q, qk_scale)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_btb
    k_head = k_cache_ptr + kvh * stride_kh
    v_head = v_cache_ptr + kvh * stride_vh
    ks_head = k_scale_ptr + kvh
    vs_head = v_scale_ptr + kvh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n in range(start, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n, m_i, end,
                                     stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, False, FP8)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_G, BLOCK_D]
    if not SPLIT:
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=qo_mask)
    else:
        # partials: part_o [B, H, num_splits, BLOCK_D], part_lse [B, H, num_splits] (log2 domain)
        part = (b * num_heads + head).to(tl.int64) * num_splits + split  # [BLOCK_G]
        g_mask = offs_g < GROUP
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o, mask=g_mask[:, None])
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=g_mask)


@triton.jit
def _row_split_tokens(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Slice length when each row cuts its own context into num_splits slices: a multiple of BLOCK_N, >= BLOCK_N."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1) * BLOCK_N


@triton.jit(do_not_specialize=["tokens_per_split", "num_splits"])
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    tokens_per_split, num_heads, num_splits,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ROW_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    if ROW_SPLITS:
        tokens_per_split = _row_split_tokens(seq_len, num_splits, BLOCK_N)
    num_valid = (seq_len + tokens_per_split - 1) // tokens_per_split
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = (offs_s < num_valid) & (offs_s < num_splits)  # [BLOCK_S]
    base = (b * num_heads + h).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence (seq_len 0): output zeros
    w = tl.exp2(lse - m)  # [BLOCK_S]
    denom = tl.sum(w, 0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                mask=s_mask[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    o = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


# Split policy constants (see _decode_split_plan).
_TARGET_CTAS_PER_SM = 4  # enough resident programs to keep HBM busy
_MAX_SPLITS = 64  # bounds the scratch buffers and the reduce tile
_MAX_SPLIT_TOKENS = 1024  # when splitting, keep slices short so shorter-than-table sequences split too
# One reduce tile for every split count: the count follows the block-table width, which differs between graph
# replays (max_model_len wide) and eager mixed steps (the step's own width), so a tile sized per count compiled a
# new variant in the middle of a run (0.2 s on an H200). Slices past num_splits are masked loads that read nothing.
_REDUCE_BLOCK_S = triton.next_power_of_2(_MAX_SPLITS)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # CPU / interpreter runs: pretend to be an H100/H200
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _decode_split_plan(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, block_n: int,
                       num_sms: int, num_splits: int | None = None, row_splits: bool = False) -> tuple[int, int]:
    """(tokens_per_split, num_splits) from shapes only — never from seq_lens values (graph capture).

    Programs are (batch x kv_heads x splits). When batch x kv_heads alone fills the GPU there is
    one split. Otherwise the table width (max_blocks * block_size tokens) is cut into enough
    slices to reach ~_TARGET_CTAS_PER_SM programs per SM, each at most _MAX_SPLIT_TOKENS long (so
    sequences much shorter than the table width still split) and at most _MAX_SPLITS slices.
    With `row_splits` each row cuts its own context into num_splits slices in the kernel (a table as wide as
    max_model_len no longer leaves a short row one live slice); tokens_per_split is then the table cut into
    num_splits, which the kernel reads only when it does not split (one slice: the whole table).
    """
    max_ctx = max(1, max_blocks * block_size)
    planned = num_splits is None
    if planned:
        ctas = max(1, batch * num_kv_heads)
        target = _TARGET_CTAS_PER_SM * num_sms
        num_splits = 1 if ctas >= target else min(triton.cdiv(target, ctas), _MAX_SPLITS)
        if row_splits:
            num_splits = min(num_splits, triton.cdiv(max_ctx, block_n))
    else:
        num_splits = max(1, min(num_splits, _MAX_SPLITS))
    tokens = triton.cdiv(max_ctx, num_splits)
    if planned and not row_splits and num_splits > 1:
        tokens = max(min(tokens, _MAX_SPLIT_TOKENS), triton.cdiv(max_ctx, _MAX_SPLITS))
    tokens = triton.cdiv(tokens, block_n) * block_n
    return tokens, num_splits if row_splits else triton.cdiv(max_ctx, tokens)


# the kv heads of a sequence side by side in the grid (=0 turns it off): with rows launched longest first, bench.py
# 0.6B 1.056x (H200, docs/benchmarks.md); with per-row splits, split launches gain too
_DECODE_HEADS_FASTEST = SWITCHES.decode_heads_fastest
_SPLIT_PLAN_BLOCK_N = 64  # split sizes are multiples of this (every default decode block_n divides it)
# each row splits its own context (see _decode_split_plan; =0: the table width is cut): at 1-32 rows a decode step
# 1.05-1.29x faster with max_model_len 40,960, bench_swap rtx4070 1.037x (H200, docs/benchmarks.md)
_DECODE_ROW_SPLITS = SWITCHES.decode_row_splits
# the bf16/fp16 tile of unsplit decode launches (full batches) at block sizes below 128, "block_m,block_n,num_warps,
# num_stages" (block_m is ignored: a GQA group is padded to 16 rows); side-by-side runs of bench.py
_DECODE_TILE = _tile_from_env("NANOVLLM_DECODE_TILE")


def _decode_config(dtype: torch.dtype, head_dim: int, block_size: int, split: bool) -> KernelConfig:
    heads_fastest = _DECODE_HEADS_FASTEST
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=2, heads_fastest=heads_fastest)
    # H200 sweep, bf16 D=128 B=256 ctx=1024: (128, 4 warps, 2 stages) ~96% of copy bw with block_size 256
    # but ~92% with block_size 16, where (64, 4, 3) gives ~96%. The big tile fits one program per SM,
    # so for split (small-batch) launches, where the wave tail matters, the smaller tile is used.
    if split or block_size < 128:
        if not split and _DECODE_TILE is not None:
            return dataclasses.replace(_DECODE_TILE, block_m=16, heads_fastest=heads_fastest)
        return KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=3, heads_fastest=heads_fastest)
    return KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=2, heads_fastest=heads_fastest)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None, config: KernelConfig | None = None,
                           row_order: torch.Tensor | None = None, row_splits: bool | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence (at its last position) over its paged context. Returns [B, H, D].

    CUDA-graph safe: no host sync, scratch sized from shapes only. ``num_splits``/``config``
    override the heuristics (tests and benchmarks). ``row_order`` [B] int32, a permutation of the rows: programs
    are launched for the rows in this order (an experiment: longest context first, so that no long row starts
    last and leaves the GPU to a few programs at the end; with ``config.heads_fastest`` a row's kv heads follow it).
    ``row_splits``: each row cuts its own context into the splits instead of the table width (None: the
    NANOVLLM_DECODE_ROW_SPLITS switch).
    """
    batch, num_heads, head_dim = q.shape  # [B, H, D]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    _check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [B, H, D]
    assert out.shape == (batch, num_heads, head_dim)
    if batch == 0:
        return out

    block_d = triton.next_power_of_2(head_dim)
    row_splits = _DECODE_ROW_SPLITS if row_splits is None else row_splits
    plan_block_n = config.block_n if config is not None else _SPLIT_PLAN_BLOCK_N
    tokens_per_split, splits = _decode_split_plan(batch, num_kv_heads, block_tables.shape[1], block_size,
                                                  plan_block_n, _sm_count(q.device), num_splits, row_splits)
    cfg = config or _decode_config(q.dtype, head_dim, block_size, splits > 1)
    assert splits == 1 or tokens_per_split % cfg.block_n == 0
    if splits > 1:
        part_o = torch.empty((batch, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    grid = (num_kv_heads, batch, splits) if cfg.heads_fastest else (batch, num_kv_heads, splits)
    fp8 = k_scale is not None
    k_scale, v_scale, scale_strides = _scale_args(k_cache, k_scale, v_scale)
    _decode_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, seq_lens, block_tables,
        row_order if row_order is not None else seq_lens,
        out, part_o, part_lse,
        scale * _LOG2E, tokens_per_split, num_heads, splits,
        *q.stride(), *out.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *scale_strides,
        block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=block_size, SPLIT=splits > 1,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        HEADS_FASTEST=cfg.heads_fastest, ORDERED=row_order is not None, ROW_SPLITS=row_splits and splits > 1,
        FP8=fp8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_o, part_lse, seq_lens, out,
            tokens_per_split, num_heads, splits,
            *out.stride(),
            HEAD_DIM=head_dim, BLOCK_S=_REDUCE_BLOCK_S, BLOCK_D=block_d, ROW_SPLITS=row_splits, BLOCK_N=cfg.block_n,
            num_warps=4,
        )
    return out


def _scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
    """(k_scale, v_scale, (stride_block, stride_token)) for the kernels; without FP8 the cache stands in for the
    unused scale pointers, which FP8=False never reads."""
    if k_scale is None:
        return k_cache, k_cache, (0, 0)
    assert v_scale is not None and k_scale.shape == v_scale.shape == k_cache.shape[:3]
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1, "scales: [N, block_size, H], H contiguous"
    return k_scale, v_scale, k_scale.stride()[:2]


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "cache views must be [N, block_size, H, D]"
    assert k_cache.shape[2] == num_kv_heads and k_cache.shape[3] == head_dim
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "head_dim must be contiguous"
    bs = k_cache.shape[1]
    assert bs >= 1 and bs & (bs - 1) == 0, "block_size must be a power of two"


__all__ = ["store_kvcache", "paged_prefill_attention", "paged_decode_attention", "KernelConfig"]
