"""Gumbel-max sampling in one pass over the logits (Triton).

argmax(logits / T + G), G ~ Gumbel(0, 1), is a draw from softmax(logits / T). The torch version
(`nanovllm.layers.sampler.gumbel_sample`) writes a noise tensor as large as the logits and reads it back: at batch
128 and a 152k vocabulary that is 78 MB each way and ~170 us a step on an H200. Here the noise comes from Philox
inside the kernel, so the logits are read once and nothing of their size is written.

Two kernels: `_chunk_argmax_kernel`, one program per (row, chunk of CHUNK vocabulary entries), writes each chunk's
best score and its token id (each Philox call gives four uniforms, one per quarter of the chunk: with one call per
entry, Philox's integer work made the kernel compute-bound, 108 us at batch 128 on an H200); `_row_argmax_kernel` picks, per row, the chunk with the best score. One program per
row over a 152k vocabulary would leave all but a few SMs idle at small batches. Greedy rows (T = 0) take the plain
argmax. Ties go to the lowest token id, as torch's argmax does.
"""
import torch
import triton
import triton.language as tl

CHUNK = 1024  # vocabulary entries per program of the first kernel


@triton.jit
def _quarter_best(logits_row_ptr, cols, vocab, u, temperature):
    """(best score, its token id) over the columns `cols` with uniforms `u`."""
    mask = cols < vocab
    x = tl.load(logits_row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
    gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-10)))
    score = tl.where(temperature == 0.0, x, x / tl.maximum(temperature, 1e-5) + gumbel)
    score = tl.where(mask, score, float("-inf"))
    return tl.max(score, 0), tl.min(tl.where(score == tl.max(score, 0), cols, 2147483647), 0)


@triton.jit(do_not_specialize=["seed"])
def _chunk_argmax_kernel(logits_ptr, temperatures_ptr, chunk_max_ptr, chunk_ids_ptr, seed, vocab, stride_row,
                         num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    QUARTER: tl.constexpr = CHUNK // 4
    idx = tl.arange(0, QUARTER)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_row
    temperature = tl.load(temperatures_ptr + row)
    # one Philox call gives four uniforms, one per quarter of the chunk (Philox is most of this kernel's work)
    u0, u1, u2, u3 = tl.rand4x(seed + row, chunk * QUARTER + idx)
    first = chunk * CHUNK + idx
    best, best_id = _quarter_best(row_ptr, first, vocab, u0, temperature)
    score, score_id = _quarter_best(row_ptr, first + QUARTER, vocab, u1, temperature)
    best_id = tl.where(score > best, score_id, best_id)  # strictly greater: ties keep the lower id
    best = tl.maximum(best, score)
    score, score_id = _quarter_best(row_ptr, first + 2 * QUARTER, vocab, u2, temperature)
    best_id = tl.where(score > best, score_id, best_id)
    best = tl.maximum(best, score)
    score, score_id = _quarter_best(row_ptr, first + 3 * QUARTER, vocab, u3, temperature)
    best_id = tl.where(score > best, score_id, best_id)
    best = tl.maximum(best, score)
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, best)
    tl.store(chunk_ids_ptr + out, best_id)


@triton.jit
def _row_argmax_kernel(chunk_max_ptr, chunk_ids_ptr, out_ptr, num_chunks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    scores = tl.load(chunk_max_ptr + row * num_chunks + offs, mask=offs < num_chunks, other=float("-inf"))
    best = tl.argmax(scores, 0)
    tl.store(out_ptr + row, tl.load(chunk_ids_ptr + row * num_chunks + best))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """Token ids [B] (int64) drawn from softmax(logits / T) per row; rows with T == 0 take the argmax. `seed` picks
    the noise (0 <= seed < 2**30): the same seed and logits give the same tokens."""
    batch, vocab = logits.shape  # [B, V]
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    num_chunks = triton.cdiv(vocab, CHUNK)
    chunk_max = torch.empty((batch, num_chunks), dtype=torch.float32, device=logits.device)
    chunk_ids = torch.empty((batch, num_chunks), dtype=torch.int64, device=logits.device)
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    _chunk_argmax_kernel[(batch, num_chunks)](logits, temperatures, chunk_max, chunk_ids, seed, vocab,
                                              logits.stride(0), num_chunks, CHUNK=CHUNK, num_warps=4)
    _row_argmax_kernel[(batch,)](chunk_max, chunk_ids, out, num_chunks,
                                 BLOCK=max(16, triton.next_power_of_2(num_chunks)), num_warps=4)
    return out
