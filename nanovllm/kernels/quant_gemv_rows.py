"""4-bit weight-only decode of a few rows (2-16) on the CUDA cores: y[:M] = x[:M] @ dequant(W).T, each packed word
loaded and unpacked once for all ROWS rows of the program (quant_gemv._int4_gemv_kernel unpacks once for at most
two). Layout and formula: quant_matmul.py's docstring; the nibbles as subnormal floats and x scaled so that every
product is exact: quant_gemv._int4_row_dot.

Where it can win, and where not: per packed word it costs ~9 integer ops to unpack eight values, then eight fmas
per row. At 75% of an H100's copy bandwidth (~0.55e12 words a second) four rows need ~22e12 ops a second of the
SMs' ~34e12 fp32 lanes, sixteen rows ~75e12: past 4-8 rows the tensor-core kernel (_wo_gemm_kernel) must carry
the multiplies, and the plan table (quant_plans.W4_DECODE_TILES) says which kernel runs at which row count, from a
sweep (benchmarks/sweep_w4.py).

As in the one- and two-row kernel, the per-word products stay in their threads until the end ([ROWS, BLOCK_N,
BLOCK_K // 8] accumulators, one fma an element a step to scale them in): summed along the words every step they
took a shuffle and an add per element (4 rows, 64 x 128 tiles on sm_90: 840 against 660 instructions a K step,
benchmarks/sass_loop.py --tiles rows 64 4), at the price of registers (214 a thread there; 128 at 32 columns, and
16 rows of 64 columns spill): the sweep weighs the two.
"""
import triton
import triton.language as tl

from nanovllm.kernels.quant_gemm import _group_params, _reduce_splits_if_last, _split_steps, _store_split
from nanovllm.kernels.quant_gemv import (_PRODUCT_LOG2, _nibble_as_subnormal, _scaled_for_nibble,
                                         _split_by_nibble, _step_words, _sum_by_word)


@triton.jit
def _x_rows_by_nibble(x_ptrs, row_ok):
    """x[r, 8 w + s] as eight [ROWS, BLOCK_K // 8] fp32 tensors, s = 0..7, for x_ptrs [ROWS, BLOCK_K // 8] pointing at
    x[r, 8 w]: one load of a word's 8 contiguous values a row, split in registers (quant_gemv._x_by_nibble's way)."""
    x = tl.load(x_ptrs[:, :, None] + tl.arange(0, 8)[None, None, :], mask=row_ok[:, :, None], other=0.0)
    return _split_by_nibble(tl.reshape(x.to(tl.float32), (x.shape[0], x.shape[1], 2, 2, 2)))


@triton.jit
def _int4_rows_dot(words, x_cols, offs_r, M, stride_xm, HAS_MINS: tl.constexpr):
    """(sums [ROWS, BLOCK_N, BLOCK_K // 8] over each word w's nibbles s of q_s x[r, 8 w + s] 2^-69, sums
    [ROWS, BLOCK_K // 8] of each word's x[r, 8 w + s] (zeros without mins)), fp32, for words [BLOCK_N, BLOCK_K // 8]
    and x_cols pointing at column 8 w of row 0; rows at or past M read 0. Each nibble's float
    (quant_gemv._nibble_as_subnormal) is built once and multiplies every row; x is scaled as in
    quant_gemv._int4_row_dot, so every product is exact."""
    x_ptrs = x_cols[None, :] + offs_r[:, None].to(tl.int64) * stride_xm  # [ROWS, BLOCK_K // 8]
    row_ok = tl.broadcast_to(offs_r[:, None] < M, x_ptrs.shape)
    xs = _x_rows_by_nibble(x_ptrs, row_ok)
    words_high = words.to(tl.uint32, bitcast=True) >> 20
    part = tl.zeros([offs_r.shape[0], words.shape[0], words.shape[1]], dtype=tl.float32)
    for s in tl.static_range(8):
        part += _nibble_as_subnormal(words, words_high, s)[None, :, :] * _scaled_for_nibble(xs[s], s)[:, None, :]
    x_sum = tl.zeros(x_ptrs.shape, dtype=tl.float32)
    if HAS_MINS:
        x_sum = _sum_by_word(xs)
    return part, x_sum


@triton.jit(do_not_specialize=["M", "num_k_steps", "num_splits"])
def _int4_gemv_rows_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, final_ptr, lock_ptr, M, N, K, num_k_steps,
                           num_splits, stride_xm, stride_qn, stride_sn, stride_mn, stride_om, stride_split,
                           REDUCE_SPLITS: tl.constexpr, ADD_OUT: tl.constexpr, GROUP_K: tl.constexpr,
                           HAS_MINS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[:M, n] (M <= ROWS) for BLOCK_N columns over num_k_steps K steps of BLOCK_K (BLOCK_K divides the group,
    the group divides K: no step runs past K); split-K partials, their in-kernel reduction and ADD_OUT as in
    quant_gemv._int4_gemv_kernel. The next step's words load while this step's are unpacked (two register buffers,
    no shared memory)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    n_ok = offs_n < N
    w_rows = q_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    acc = tl.zeros([ROWS, BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    k_begin, num_steps = _split_steps(K, num_k_steps, BLOCK_K)
    k_end = k_begin + num_steps * BLOCK_K
    words = _step_words(w_rows, n_ok, k_begin, k_end, BLOCK_K)
    for step in range(num_steps):
        k0 = k_begin + step * BLOCK_K
        next_words = _step_words(w_rows, n_ok, k0 + BLOCK_K, k_end, BLOCK_K)
        # sum(x (q s + mn)) = s 2^69 sum(x q 2^-69) + mn sum(x)
        s, mn = _group_params(s_ptr, m_ptr, offs_n, k0 // GROUP_K, N, stride_sn, stride_mn, 1, HAS_MINS, 0.0)
        part, x_sum = _int4_rows_dot(words, x_ptr + k0 + 8 * tl.arange(0, BLOCK_K // 8), offs_r, M, stride_xm,
                                     HAS_MINS)
        acc += (s * (2.0 ** -_PRODUCT_LOG2))[None, :, None] * part
        if HAS_MINS:
            acc += x_sum[:, None, :] * mn[None, :, None]
        words = next_words
    acc = tl.sum(acc, axis=2)
    offs = offs_r[:, None].to(tl.int64) * stride_om + offs_n[None, :]  # [ROWS, BLOCK_N]
    mask = (offs_r[:, None] < M) & n_ok[None, :]
    _store_split(out_ptr + tl.program_id(1) * stride_split + offs, acc, mask, num_splits, ADD_OUT)
    if REDUCE_SPLITS:
        _reduce_splits_if_last(final_ptr, out_ptr, lock_ptr, tl.program_id(0), offs, mask, num_splits, stride_split,
                               ADD_OUT)
