"""Structured outputs' token bitmask applied to the logits in place (Triton), read packed: each program takes one
constrained row and BLOCK vocabulary entries, loads the words that hold their bits, and writes -inf where a bit is 0.
The unpacked torch path it replaces (nanovllm/layers/token_bitmask.py: unpack_bits) made two int32 [rows, V]
intermediates a step (39 MB each at 64 rows of Qwen3's 151,936 tokens) and a gather and scatter for a batch that
mixes constrained and free rows; here nothing is allocated and the rows are indexed in the kernel.
"""
import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries per program (128 words of the bitmask)


@triton.jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, logits_stride, num_words,
                                BLOCK: tl.constexpr):
    i = tl.program_id(0)  # the bitmask's row i masks the logits' row rows[i]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    words = tl.load(bitmask_ptr + i * num_words + cols // 32, mask=in_vocab, other=-1)  # [BLOCK], 32 alike in a row
    banned = ((words >> (cols % 32)) & 1) == 0  # bit t % 32 of word t // 32 allows token t (an arithmetic shift:
    # a set sign bit spreads left, never into bit 0)
    row = tl.load(rows_ptr + i).to(tl.int64)
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + cols, neg_inf, mask=in_vocab & banned)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (each row contiguous), in place: row rows[i] becomes -inf where bitmask[i] ([n, W] int32,
    W >= ceil(V / 32), each row contiguous) has a 0 bit. rows: [n] int32 on the logits' device. Returns logits."""
    num_rows, vocab = rows.numel(), logits.size(1)
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, "logits and bitmask rows must be contiguous"
    if num_rows:
        _apply_token_bitmask_kernel[(num_rows, triton.cdiv(vocab, BLOCK))](
            logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK, num_warps=4)
    return logits
