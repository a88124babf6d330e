"""Prefill attention over the paged KV cache: causal flash attention for a varlen batch whose K/V are all read from
the cache (cached prefix + the tokens just stored).

The query tile packs ``BLOCK_Q`` tokens x ``GROUP`` query heads of one kv head into ``BLOCK_M = BLOCK_Q * GROUP``
rows, so each K/V tile is loaded once per GQA group. The 1-D grid runs over the q tiles of all sequences (binary
search in ``cu_seqlens_q``), heaviest tiles first; key tiles left of the diagonal skip the causal mask.
A mixed step's one-token rows do not come here when the backend splits mixed steps (engine/step_inputs.py,
split_mixed): each would take a whole query tile (block_m rows, prefill_config) for one token; they go to the
decode kernel instead.
"""

import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged_common import LOG2E, KernelConfig, attend_tile, check_cache, head_pointers, \
    query_for_cache, scale_args, tile_from_env


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
# One piece: the q tile and the running softmax state stay in registers from the load through both key loops to the
# store, and the per-tile work already lives in attend_tile; splitting the rest would pass a dozen pointers and
# strides between jit helpers for no gain in reading.
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
    q, qk_scale = query_for_cache(q, qk_scale, FP8)

    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_btb
    k_head, v_head, ks_head, vs_head = head_pointers(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kvh,
                                                     stride_kh, stride_vh)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    first_pos = ctx_start + q_tile * BLOCK_Q
    kv_end = ctx_start + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)  # one past the last visible key
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # key tiles below this are visible to every row
    for n in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n, q_pos, kv_end,
                                     stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, False, False, FP8)
    for n in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n, q_pos, kv_end,
                                     stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                                     HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, True, FP8)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=q_mask)


# the bf16/fp16 tile from NANOVLLM_PREFILL_TILE (None: the tuned default), read once at import
_PREFILL_TILE = tile_from_env("NANOVLLM_PREFILL_TILE")


def prefill_config(dtype: torch.dtype, head_dim: int) -> KernelConfig:
    """The prefill kernel's default tile for this dtype and head size."""
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
    check_cache(k_cache, v_cache, num_kv_heads, head_dim)
    assert num_heads % num_kv_heads == 0
    group = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [T, H, D]
    assert out.shape == (num_tokens, num_heads, head_dim)
    if num_tokens == 0 or num_seqs == 0:
        return out

    cfg = config or prefill_config(q.dtype, head_dim)
    # small tiles when every query run is short (e.g. mostly-decode batches)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(max(1, max_query_len) * group)))
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    fp8 = k_scale is not None
    k_scale, v_scale, scale_strides = scale_args(k_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, out, cu_seqlens_q, seq_lens, block_tables,
        scale * LOG2E, num_seqs,
        *q.stride(), *out.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *scale_strides,
        block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=cfg.block_n, BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# --------------------------------------------------------------------------------------------
