"""A stand-in for the `flash_attn` package (2.x) in plain torch, so FlashBackend's glue runs on the CPU.

It keeps the two functions' documented signatures and semantics and checks what flash-attn's C++ checks (half
precision, int32 index tensors, a last dimension of stride 1, paged blocks of a multiple of 256 tokens), so glue that
would be refused on a GPU is refused here too. Causal masks are aligned to the bottom-right corner (flash-attn >=
2.1): query i of a row with Lq queries and Lk keys sees keys j <= i + Lk - Lq. Install it with `install(monkeypatch)`.
"""
import importlib.machinery
import sys
import types

import torch

PAGE_MULTIPLE = 256  # "Paged KV cache block size must be divisible by 256"
CALLS: list[str] = []  # which function ran, in order (tests assert the glue reached the one they expect)


def install(monkeypatch) -> types.ModuleType:
    module = types.ModuleType("flash_attn")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)  # importlib.util.find_spec finds it
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    CALLS.clear()
    return module


def _check_common(q, k_cache, v_cache, block_table):
    assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type"
    assert k_cache.dtype == q.dtype and v_cache.dtype == q.dtype, "query and key must have the same dtype"
    for t in (q, k_cache, v_cache):
        assert t.stride(-1) == 1, "Input tensor must have contiguous last dimension"
    assert block_table.dtype == torch.int32, "block_table must have dtype torch.int32"
    assert block_table.stride(-1) == 1, "block_table must have contiguous last dimension"
    assert k_cache.size(1) % PAGE_MULTIPLE == 0, "Paged KV cache block size must be divisible by 256"
    assert q.size(-2) % k_cache.size(-2) == 0, "Number of heads in key/value must divide number of heads in query"


def _paged(cache, table_row, seqlen_k: int):
    """The first seqlen_k tokens of a sequence's paged K or V: [seqlen_k, nheads_k, headdim]."""
    num_blocks = -(-seqlen_k // cache.size(1))
    block_ids = table_row[:num_blocks].long()
    assert bool((block_ids >= 0).all()) and bool((block_ids < cache.size(0)).all()), "block id out of range"
    return cache[block_ids].flatten(0, 1)[:seqlen_k]


def _attention(q, k, v, scale: float, causal: bool):
    """q [Lq, H, D], k / v [Lk, Hk, D] -> [Lq, H, D], float32 inside, q's dtype out."""
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, Lq, Lk]
    if causal:
        lq, lk = q.size(0), k.size(0)
        mask = torch.arange(lk)[None, :] > torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """q [total_q, H, D]; with block_table, k / v are paged [num_blocks, page_block_size, Hk, D] and cu_seqlens_k
    gives each sequence's number of keys. Returns [total_q, H, D]."""
    CALLS.append("varlen")
    assert block_table is not None, "the glue always passes a block table (the cache is paged)"
    _check_common(q, k, v, block_table)
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "cu_seqlens must have dtype int32"
    assert dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0 and alibi_slopes is None
    batch = cu_seqlens_q.numel() - 1
    assert cu_seqlens_k.numel() == batch + 1 and block_table.size(0) == batch
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    out = torch.empty_like(q)
    for b in range(batch):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert q1 - q0 <= max_seqlen_q and seqlen_k <= max_seqlen_k, "max_seqlen below a sequence's length"
        k_b, v_b = _paged(k, block_table[b], seqlen_k), _paged(v, block_table[b], seqlen_k)
        out[q0:q1] = _attention(q[q0:q1], k_b, v_b, scale, causal)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """q [B, Lq, H, D]; k_cache / v_cache paged [num_blocks, page_block_size, Hk, D] through block_table
    [B, max_blocks]; cache_seqlens [B] int32 keys per row. Returns [B, Lq, H, D]."""
    CALLS.append("with_kvcache")
    assert k is None and v is None and rotary_cos is None, "the glue stores K/V itself (Triton), no rotary here"
    assert block_table is not None and cache_batch_idx is None and cache_leftpad is None
    _check_common(q, k_cache, v_cache, block_table)
    assert cache_seqlens.dtype == torch.int32, "cache_seqlens must have dtype int32"
    scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
    out = torch.empty_like(q)
    for b in range(q.size(0)):
        seqlen_k = int(cache_seqlens[b])
        k_b, v_b = _paged(k_cache, block_table[b], seqlen_k), _paged(v_cache, block_table[b], seqlen_k)
        out[b] = _attention(q[b], k_b, v_b, scale, causal)
    return out
