"""4-bit weight-only decode of a few rows (2-16) on the CUDA cores: y[:M] = x[:M] @ dequant(W).T, each packed word
loaded and unpacked once for all ROWS rows of the program (quant_gemv._int4_gemv_kernel unpacks once for at most
two). Layout and formula: quant_matmul.py's docstring; the float 1 + q / 16 built from bits
(quant_gemv._nibble_over_16_plus_1) and the scale applied to per-step sums: quant_gemv._int4_row_dot.

Where it can win, and where not: per packed word it costs ~16 integer ops to unpack eight values, then eight fmas
per row. At 75% of an H100's copy bandwidth (~0.55e12 words a second) four rows need ~25e12 ops a second of the
SMs' ~34e12 fp32 lanes, sixteen rows ~80e12: past 4-8 rows the tensor-core kernel (_wo_gemm_kernel) must carry
the multiplies, and the plan table (quant_plans.W4_DECODE_TILES) says which kernel runs at which row count, from a
sweep (benchmarks/sweep_w4.py).

Unlike the one- and two-row kernel, the per-word partial sums are reduced along K every step ([ROWS, BLOCK_N]
accumulators): a [ROWS, BLOCK_N, BLOCK_K // 8] accumulator kept to the end would double the registers of the step's
products, which already take ROWS * BLOCK_N * BLOCK_K / 8 values a program.
"""
import triton
import triton.language as tl

from nanovllm.kernels.quant_gemm import _group_params, _reduce_splits_if_last, _split_steps
from nanovllm.kernels.quant_gemv import _nibble_over_16_plus_1


@triton.jit
def _int4_rows_dot(words, x_cols, offs_r, M, stride_xm):
    """(sums [ROWS, BLOCK_N] over the step's words w and nibbles s of (1 + q_s / 16) * x[r, 8 w + s], sums [ROWS] of
    the step's x[r, :]), fp32, for words [BLOCK_N, BLOCK_K // 8] and x_cols pointing at column 8 w of row 0; rows
    at or past M read 0. Each nibble's float is built once and multiplies every row."""
    x_ptrs = x_cols[None, :] + offs_r[:, None].to(tl.int64) * stride_xm  # [ROWS, BLOCK_K // 8]
    row_ok = offs_r[:, None] < M  # [ROWS, 1], broadcast by the load
    part = tl.zeros([offs_r.shape[0], words.shape[0], words.shape[1]], dtype=tl.float32)
    x_sum = tl.zeros(x_ptrs.shape, dtype=tl.float32)
    for s in tl.static_range(8):
        f = _nibble_over_16_plus_1(words, s)  # [BLOCK_N, BLOCK_K // 8]
        x = tl.load(x_ptrs + s, mask=row_ok, other=0.0).to(tl.float32)  # [ROWS, BLOCK_K // 8]
        part += f[None, :, :] * x[:, None, :]
        x_sum += x
    return tl.sum(part, axis=2), tl.sum(x_sum, axis=1)


@triton.jit(do_not_specialize=["M", "num_k_steps", "num_splits"])
def _int4_gemv_rows_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, final_ptr, lock_ptr, M, N, K, num_k_steps,
                           num_splits, stride_xm, stride_qn, stride_sn, stride_mn, stride_om, stride_split,
                           REDUCE_SPLITS: tl.constexpr, GROUP_K: tl.constexpr, HAS_MINS: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[:M, n] (M <= ROWS) for BLOCK_N columns over num_k_steps K steps of BLOCK_K (BLOCK_K divides the group,
    the group divides K: no step runs past K); split-K partials and their in-kernel reduction as in
    quant_gemv._int4_gemv_kernel. The next step's words load while this step's are unpacked (two register buffers,
    no shared memory)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    n_ok = offs_n < N
    w_rows = q_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    k_begin, num_steps = _split_steps(K, num_k_steps, BLOCK_K)
    k_end = k_begin + num_steps * BLOCK_K
    offs_w = k_begin // 8 + tl.arange(0, BLOCK_K // 8)
    words = tl.load(w_rows + offs_w[None, :], mask=n_ok[:, None], other=0)  # [BLOCK_N, BLOCK_K // 8]
    for step in range(num_steps):
        k0 = k_begin + step * BLOCK_K
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        offs_next = offs_w + BLOCK_K // 8
        next_words = tl.load(w_rows + offs_next[None, :], other=0,
                             mask=n_ok[:, None] & (offs_next[None, :] < k_end // 8))
        # sum(x q) s + sum(x) mn = 16 s sum(x (1 + q / 16)) + (mn - 16 s) sum(x)
        s, bias = _group_params(s_ptr, m_ptr, offs_n, k0 // GROUP_K, N, stride_sn, stride_mn, 1, HAS_MINS, 16.0)
        part, x_sum = _int4_rows_dot(words, x_ptr + offs_w * 8, offs_r, M, stride_xm)
        acc += (16.0 * s)[None, :] * part + x_sum[:, None] * bias[None, :]
        words = next_words
    offs = offs_r[:, None].to(tl.int64) * stride_om + offs_n[None, :]  # [ROWS, BLOCK_N]
    mask = (offs_r[:, None] < M) & n_ok[None, :]
    tl.store(out_ptr + tl.program_id(1) * stride_split + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if REDUCE_SPLITS:
        _reduce_splits_if_last(final_ptr, out_ptr, lock_ptr, tl.program_id(0), offs, mask, num_splits, stride_split)
