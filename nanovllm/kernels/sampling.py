"""Sampling from softmax(logits / T) by inverse transform, in two passes over the logits (Triton).

The torch path (`nanovllm.layers.sampler.gumbel_sample`) draws Gumbel noise for every vocabulary entry: at batch 128
and a 152k vocabulary it writes and reads back a noise tensor as large as the logits (~170 us a step on an H200), and
a Triton version of the same race that makes the noise in-kernel spent 79-108 us on Philox and two logarithms per
entry (docs/benchmarks.md). Here each row needs one uniform number and each entry one exp2:

* `_chunk_stats_kernel`, one program per (row, chunk of CHUNK entries): the chunk's largest scaled logit
  m = max(x * log2(e) / T) and s = sum(2^(x * log2(e) / T - m)), its largest raw logit and that logit's token id
  (for greedy rows, T = 0).
* `_row_sample_kernel`, one program per row: the chunks' masses w = s * 2^(m - M) (M: the row's largest m), a
  uniform u, the chunk where the running sum of w passes u * sum(w), then the entry inside that chunk where the
  running sum of 2^(x * log2(e) / T - M) passes what is left. Greedy rows take the largest logit (ties: lowest id).

One program per row over a 152k vocabulary would leave all but a few SMs idle at small batches, hence the chunks.
"""
import torch
import triton
import triton.language as tl

CHUNK = 1024  # vocabulary entries per program of the first kernel
# in the kernels: 1.4426950408889634 is log2(e); 2147483647, larger than any token id, loses every tie


@triton.jit
def _chunk_stats_kernel(logits_ptr, temperatures_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_best_ptr, chunk_best_id_ptr,
                        vocab, stride_row, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)  # [CHUNK]
    out = row * num_chunks + chunk
    best = tl.max(x, 0)
    tl.store(chunk_best_ptr + out, best)
    tl.store(chunk_best_id_ptr + out, tl.min(tl.where(x == best, cols, 2147483647), 0))
    scale = 1.4426950408889634 / tl.maximum(tl.load(temperatures_ptr + row), 1e-5)
    y = tl.minimum(x * scale, 3.0e38)  # log2 domain; finite, so that an overflowed (inf) logit wins, not NaN
    m = tl.max(y, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # a chunk of -inf logits has mass 0, not NaN
    tl.store(chunk_max_ptr + out, m)
    tl.store(chunk_sum_ptr + out, tl.sum(tl.exp2(y - m_safe), 0))


@triton.jit(do_not_specialize=["seed"])
def _row_sample_kernel(logits_ptr, temperatures_ptr, chunk_max_ptr, chunk_sum_ptr, chunk_best_ptr, chunk_best_id_ptr,
                       out_ptr, seed, vocab, stride_row, num_chunks, BLOCK_C: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    c_mask = offs < num_chunks
    stats = row * num_chunks + offs
    temperature = tl.load(temperatures_ptr + row)
    if temperature == 0.0:  # greedy: the largest logit over the chunks' best ones
        best = tl.load(chunk_best_ptr + stats, mask=c_mask, other=float("-inf"))
        ids = tl.load(chunk_best_id_ptr + stats, mask=c_mask, other=2147483647)
        token = tl.min(tl.where(best == tl.max(best, 0), ids, 2147483647), 0)
    else:
        m = tl.load(chunk_max_ptr + stats, mask=c_mask, other=float("-inf"))
        s = tl.load(chunk_sum_ptr + stats, mask=c_mask, other=0.0)
        row_max = tl.max(m, 0)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        w = tl.where(m == float("-inf"), 0.0, s * tl.exp2(m - row_max))  # [BLOCK_C] chunk masses
        target = tl.rand(seed, row) * tl.sum(w, 0)
        # the chunk where the running mass passes target (rounding can leave target past the end: the last chunk
        # with mass then takes it)
        chunk = tl.sum((tl.cumsum(w, 0) <= target).to(tl.int32), 0)
        chunk = tl.minimum(chunk, tl.max(tl.where(w > 0.0, offs, 0), 0))
        target -= tl.sum(tl.where(offs < chunk, w, 0.0), 0)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                    other=float("-inf")).to(tl.float32)
        scale = 1.4426950408889634 / tl.maximum(temperature, 1e-5)
        p = tl.exp2(tl.minimum(x * scale, 3.0e38) - row_max)  # [CHUNK], on the scale of w
        k = tl.sum((tl.cumsum(p, 0) <= target).to(tl.int32), 0)
        k = tl.minimum(k, tl.max(tl.where(p > 0.0, tl.arange(0, CHUNK), 0), 0))
        token = chunk * CHUNK + k
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_tempered(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """Token ids [B] (int64) drawn from softmax(logits / T) per row; rows with T == 0 take the argmax (ties: the
    lowest id). `seed` picks the uniforms (0 <= seed < 2**30): the same seed and logits give the same tokens."""
    batch, vocab = logits.shape  # [B, V]
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    num_chunks = triton.cdiv(vocab, CHUNK)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    # separate allocations, not views of one: a view's address alignment would follow the batch size, and Triton
    # compiles a kernel variant per alignment (a compile in the middle of a run)
    chunk_max, chunk_sum, chunk_best = (torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
                                        for _ in range(3))
    chunk_best_id = torch.empty((batch, num_chunks), dtype=torch.int32, device=logits.device)
    _chunk_stats_kernel[(batch, num_chunks)](logits, temperatures, chunk_max, chunk_sum, chunk_best, chunk_best_id,
                                             vocab, logits.stride(0), num_chunks, CHUNK=CHUNK, num_warps=4)
    _row_sample_kernel[(batch,)](logits, temperatures, chunk_max, chunk_sum, chunk_best, chunk_best_id, out, seed,
                                 vocab, logits.stride(0), num_chunks,
                                 BLOCK_C=max(16, triton.next_power_of_2(num_chunks)), CHUNK=CHUNK, num_warps=4)
    return out
