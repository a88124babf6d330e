"""Paged attention behind a small backend interface.

Every backend does three things on one layer's cache views (`LayerKV`, nanovllm/layers/kv_layout.py: `k`, `v` of
shape [num_blocks, block_size, num_kv_heads, head_dim], views of the block-major cache, so dim 0 is strided; with an
FP8 cache also `k_scale`, `v_scale` [num_blocks, block_size, num_kv_heads], one scale per token and kv head):
- store_kv: write the new tokens' K and V at their slots;
- prefill: varlen causal attention where each sequence's queries are the last tokens of its context and every
  key/value (cached prefix and new tokens alike) is read from the cache through the block table;
- decode: one query per sequence.
prefill and decode write into `out` when given. In a mixed step (some rows decode, some prefill), backends with
`splits_mixed_steps` get the one-token rows through decode and the rest through prefill (the runner splits the
metadata); flash-attn's varlen kernel takes the whole mixed batch, as in vLLM.
`TorchBackend` is the reference: plain torch, CPU and GPU; the Triton and flash-attn backends are tested against it.
With an FP8 cache, K arrives rotated by the layout's Hadamard matrix and so does q (the layer rotates both), so
backends only quantize on store and apply the scales on read.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.kv_layout import LayerKV, dequantize_fp8, quantize_fp8
from nanovllm.utils.context import AttentionMetadata, get_context


class TorchBackend:
    name = "torch"
    splits_mixed_steps = True  # it gains nothing (its prefill loops over sequences), but CPU tests cover the split
    longest_first = False  # whether decode reads md.decode_row_order (the Triton decode kernel's launch order)

    def store_kv(self, k, v, kv: LayerKV, md: AttentionMetadata):
        valid = md.slot_mapping >= 0
        slots = md.slot_mapping[valid]
        block_size = kv.k.size(1)
        block_ids, offsets = slots // block_size, slots % block_size
        for x, cache, scales in ((k, kv.k, kv.k_scale), (v, kv.v, kv.v_scale)):
            if kv.is_fp8:
                values, token_scales = quantize_fp8(x[valid], cache.dtype)
                cache[block_ids, offsets] = values
                scales[block_ids, offsets] = token_scales
            else:
                cache[block_ids, offsets] = x[valid]

    @staticmethod
    def _gather(cache: torch.Tensor, scales: torch.Tensor | None, block_ids: torch.Tensor) -> torch.Tensor:
        """[*block_ids.shape, block_size, num_kv_heads, head_dim] of the blocks, dequantized to fp32 if FP8."""
        if scales is None:
            return cache[block_ids]
        return dequantize_fp8(cache[block_ids], scales[block_ids])

    def prefill(self, q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        block_size = kv.k.size(1)
        start = 0
        for i, (query_len, seq_len) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
            block_ids = md.block_tables[i, :(seq_len + block_size - 1) // block_size]
            k = self._gather(kv.k, kv.k_scale, block_ids).flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
            v = self._gather(kv.v, kv.v_scale, block_ids).flatten(0, 1)[:seq_len]
            qi = q[start:start + query_len]  # [query_len, num_heads, head_dim]
            group = qi.size(1) // k.size(1)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [seq_len, num_heads, head_dim]
            scores = torch.einsum("qhd,khd->hqk", qi.float(), k.float()) * scale  # [num_heads, query_len, seq_len]
            q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] > q_pos[:, None]
            probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
            out[start:start + query_len] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
            start += query_len
        return out

    def decode(self, q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv.k.size(2)
        block_tables = md.block_tables.clamp(min=0)
        k = self._gather(kv.k, kv.k_scale, block_tables).flatten(1, 2)  # [B, max_blocks * block_size, kv_heads, D]
        v = self._gather(kv.v, kv.v_scale, block_tables).flatten(1, 2)
        valid = torch.arange(k.size(1), device=q.device)[None, :] < md.seq_lens[:, None]  # [B, S]
        v = torch.where(valid[:, :, None, None], v, 0)  # a slot past the end may hold anything, NaN included
        qg = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.einsum("bngd,bsnd->bngs", qg.float(), k.float()) * scale
        probs = scores.masked_fill(~valid[:, None, None, :], float("-inf")).softmax(-1)
        result = torch.einsum("bngs,bsnd->bngd", probs, v.float()).reshape(num_seqs, num_heads, head_dim)
        return result.to(q.dtype) if out is None else out.copy_(result)


class TritonBackend:
    name = "triton"
    splits_mixed_steps = True

    def __init__(self):
        from nanovllm.kernels.decode_attention import paged_decode_attention
        from nanovllm.kernels.prefill_attention import paged_prefill_attention
        from nanovllm.kernels.store_kv import store_kvcache
        self.store_kvcache, self.paged_prefill_attention = store_kvcache, paged_prefill_attention
        self.paged_decode_attention = paged_decode_attention
        # the decode kernel launches rows longest context first, so no long row starts last and leaves the GPU to a
        # few programs; the first layer sorts them once per forward (_order_decode_rows)
        self.longest_first = True

    def store_kv(self, k, v, kv: LayerKV, md: AttentionMetadata):
        self.store_kvcache(k, v, kv.k, kv.v, md.slot_mapping, kv.k_scale, kv.v_scale)

    def prefill(self, q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        return self.paged_prefill_attention(q, kv.k, kv.v, md.cu_seqlens_q, md.seq_lens, md.block_tables,
                                            md.max_query_len, scale, out=out, k_scale=kv.k_scale, v_scale=kv.v_scale)

    def decode(self, q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        return self.paged_decode_attention(q, kv.k, kv.v, md.seq_lens, md.block_tables, scale, out=out,
                                           row_order=md.decode_row_order, k_scale=kv.k_scale, v_scale=kv.v_scale)


class FlashBackend(TritonBackend):
    """flash-attn for attention (paged through block_table), Triton for the KV store."""
    name = "flash"
    splits_mixed_steps = False

    def __init__(self):
        super().__init__()
        self.longest_first = False
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.varlen, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def prefill(self, q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        cu_seqlens_k = F.pad(md.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))  # [B + 1]
        result = self.varlen(q, kv.k, kv.v, cu_seqlens_q=md.cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                             max_seqlen_q=md.max_query_len, max_seqlen_k=md.max_seq_len, softmax_scale=scale,
                             causal=True, block_table=md.block_tables)
        return result if out is None else out.copy_(result)

    def decode(self, q, kv: LayerKV, md: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
        result = self.with_kvcache(q.unsqueeze(1), kv.k, kv.v, cache_seqlens=md.seq_lens,
                                   block_table=md.block_tables, softmax_scale=scale, causal=True).squeeze(1)
        return result if out is None else out.copy_(result)


def select_backend(name: str, device: torch.device, block_size: int):
    """"auto" picks only backends this project tests on their device: the Triton kernels on CUDA, torch on the CPU.
    flash-attn runs only when asked for ("flash"): its glue is tested on the CPU against a stand-in module, but the
    kernel itself has never run in this project (docs/api.md), and its paged KV needs blocks of a multiple of 256
    tokens, 4x coarser for swapping and prefix hits."""
    if name == "flash" and block_size % 256:
        raise ValueError(f"attention_backend='flash' needs kvcache_block_size a multiple of 256, got {block_size}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name != "torch" and device.type != "cuda":
        raise ValueError(f"attention_backend={name!r} needs a CUDA device; use 'torch' on {device.type}")
    return {"torch": TorchBackend, "triton": TritonBackend, "flash": FlashBackend}[name]()


class Attention(nn.Module):
    """One layer's paged attention. The runner binds `kv` (this layer's cache views), the backend and, for an FP8
    cache, `rotation` (the Hadamard matrix K is stored rotated by) before the first forward."""

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.scale, self.num_kv_heads = num_heads, head_dim, scale, num_kv_heads
        self.kv: LayerKV | None = None  # None during the memory-profiling run
        self.rotation: torch.Tensor | None = None  # [head_dim, head_dim] fp32, FP8 caches only
        self.backend = None
        self.fused_rope_store = False  # the runner turns it on with the cache (Triton or flash backend)
        self.is_first_layer = False  # set by the runner: computes the step's per-forward attention metadata

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out=None) -> torch.Tensor:
        md = get_context()
        if self.kv is None:  # the memory-profiling run
            return self._profile_attention(q, k, v, md.max_seq_len, out)
        if self.rotation is not None:  # q . k is unchanged: H is orthogonal (kv_layout.py says why K is rotated)
            q = (q.float() @ self.rotation).to(q.dtype)
            k = k.float() @ self.rotation  # quantized from fp32
        self.backend.store_kv(k, v, self.kv, md)
        return self._attend(q, md, out)

    def rope_store(self, qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                   q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """The fused path's first half: (q/k norm,) rope and the KV store in one kernel; returns q
        [T, num_heads, head_dim]. qkv is the qkv projection's output [T, (num_heads + 2 * num_kv_heads) * head_dim]
        and nothing returned refers to it."""
        from nanovllm.kernels.rope_store import rope_store_kvcache
        md, kv = get_context(), self.kv
        return rope_store_kvcache(qkv, positions, cos_sin_cache, self.num_heads, self.num_kv_heads, self.head_dim,
                                  kv.k, kv.v, md.slot_mapping, q_weight, k_weight, eps, kv.k_scale, kv.v_scale,
                                  self.rotation)

    def attend_stored(self, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fused path's second half: attention of q over the cache that rope_store wrote."""
        return self._attend(q, get_context(), out)

    def _attend(self, q: torch.Tensor, md: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, num_heads, head_dim], written into `out` when given."""
        if md.is_decode_only:
            self._order_decode_rows(md)
            return self.backend.decode(q, self.kv, md, self.scale, out=out)
        if md.decode_part is None:
            return self.backend.prefill(q, self.kv, md, self.scale, out=out)
        # a mixed step: the leading one-token rows through decode, the prompt chunks through prefill
        d, out = len(md.decode_part.seq_lens_cpu), torch.empty_like(q) if out is None else out
        self._order_decode_rows(md.decode_part)
        self.backend.decode(q[:d], self.kv, md.decode_part, self.scale, out=out[:d])
        self.backend.prefill(q[d:], self.kv, md.prefill_part, self.scale, out=out[d:])
        return out

    def _order_decode_rows(self, md: AttentionMetadata):
        """The first layer sorts the rows by context length, on the device, once per forward: inside a CUDA graph
        the sort is captured with the forward, so a replay sorts the replay's lengths."""
        if self.backend.longest_first and (self.is_first_layer or md.decode_row_order is None):
            md.decode_row_order = torch.argsort(md.seq_lens, descending=True).to(torch.int32)

    def _profile_attention(self, q, k, v, seq_len: int, out=None) -> torch.Tensor:
        """Attention without a cache, for the profiling run that sizes the KV cache: the tokens are
        consecutive causal sequences of seq_len tokens each. One query head at a time, reading its KV head in place
        and writing its slice of `out`, so that the profile holds what the paged kernels hold (q, k, v and the
        output): K and V repeated for every query head and a strided output copy were 192 MiB of Qwen3-8B's
        8,192-token step that no real step allocates."""
        out = torch.empty_like(q) if out is None else out  # [T, nh, hd]
        group = self.num_heads // self.num_kv_heads

        def head(x, i):  # [N, 1, seq_len, D], a view of head i
            return x[:, i:i + 1].view(-1, seq_len, 1, x.size(-1)).transpose(1, 2)
        for i in range(self.num_heads):
            head(out, i).copy_(F.scaled_dot_product_attention(head(q, i), head(k, i // group), head(v, i // group),
                                                              is_causal=True, scale=self.scale))
        return out
