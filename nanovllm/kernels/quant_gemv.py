"""Weight-only decode of one or two rows on the CUDA cores, no tensor-core dot: y[:M] = x[:M] @ dequant(W).T for
4-bit weights (_int4_gemv_kernel) and for 8-bit weights without mins (_byte_gemv_kernel: FP8 e4m3, or int8 as the
8-bit LM head stores it). Layouts and the dequantization formula: quant_matmul.py's docstring; split-K and the
in-kernel reduction of the splits are quant_gemm.py's (_split_steps, _store_rows), the plans quant_plans.py's.

At one or two rows a kernel like these is bound by the instructions it issues as much as by memory: an H100 SM issues
128 thread instructions a clock, so at ~5 instructions a 4-bit value its 132 SMs unpack about the 3 TB/s of copy
bandwidth in weights. What each value costs is in the kernels' docstrings; benchmarks/sass_loop.py counts it.
"""
import triton
import triton.language as tl

from nanovllm.kernels.quant_gemm import _group_params, _split_steps, _store_rows


@triton.jit
def _step_words(w_rows, n_ok, k0, k_end, BLOCK_K: tl.constexpr):
    """The packed words [BLOCK_N, BLOCK_K // 8] of the K step at column k0 for the rows w_rows points at (a row's
    words contiguous); 0 past N and from k_end on (the split's end: the prefetch after its last step reads nothing)."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    return tl.load(w_rows + offs_w[None, :], mask=n_ok[:, None] & (offs_w[None, :] < k_end // 8), other=0)


@triton.jit
def _x_by_nibble(x_cols, row_ok):
    """x[8 w + s] as eight [BLOCK_K // 8] fp32 vectors, s = 0..7, for x_cols pointing at x[8 w]: one [BLOCK_K // 8, 8]
    load (a word's 8 values are 16 contiguous bytes, one vector load) split in registers. Loaded one nibble at a time,
    strided by 16 bytes, they took a load and a zero-fill per value a thread, a seventh of the one-row kernel's loop
    on sm_90 (benchmarks/sass_loop.py counts it)."""
    x = tl.load(x_cols[:, None] + tl.arange(0, 8)[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    return _split_by_nibble(tl.reshape(x, (x.shape[0], 2, 2, 2)))


@triton.jit
def _split_by_nibble(x):
    """x [..., 2, 2, 2] (the last three dimensions s // 4, s // 2 % 2, s % 2 of a word's values s = 0..7) as its
    eight [...] slices, in order of s: register moves, no memory."""
    x_s_even, x_s_odd = tl.split(x)
    x0, x4 = tl.split(tl.split(x_s_even)[0])
    x2, x6 = tl.split(tl.split(x_s_even)[1])
    x1, x5 = tl.split(tl.split(x_s_odd)[0])
    x3, x7 = tl.split(tl.split(x_s_odd)[1])
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _sum_by_word(xs):
    """The sum of the eight slices of _split_by_nibble: each word's values summed (the min term's sum(x))."""
    return ((xs[0] + xs[1]) + (xs[2] + xs[3])) + ((xs[4] + xs[5]) + (xs[6] + xs[7]))


# The one- and two-row kernel's products x q 2^-69 (_int4_row_dot): x[8 w + s] is scaled by 2^(80 - p) where the
# nibble's float is q 2^(p - 149), so every product is exact and normal for |x q| >= 2^-57 (a smaller one rounds
# to a multiple of 2^-149, 2^-80 of a unit) and the scaled x stays finite below |x| = 2^48 (2.8e14; fp16's largest
# is 65504, and activations past that would be a broken model's)
_PRODUCT_LOG2 = tl.constexpr(-69)


@triton.jit
def _nibble_as_subnormal(words, words_high, s: tl.constexpr):
    """q 2^(p - 149) for nibble s of each int32 word, p = 4 (s % 5): the nibble masked where it lies, inside
    the mantissa of a float whose exponent bits are 0, a subnormal linear in q; nibbles 5-7 from words_high (the
    words shifted right by 20, once for all three). One and a value, with one constant (the 1 + q / 16 floats
    needed an and-or with two, and ptxas spent a move a value rematerializing the second)."""
    if s < 5:
        bits = words & (0xF << (4 * s))
    else:
        bits = (words_high & (0xF << (4 * (s - 5)))).to(tl.int32, bitcast=True)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scaled_for_nibble(x, s: tl.constexpr):
    """x times 2^(149 + _PRODUCT_LOG2 - p), p = 4 (s % 5) the bit where nibble s's subnormal float puts it
    (_nibble_as_subnormal): a power of two, exact, so that x q 2^_PRODUCT_LOG2 comes out of the product."""
    return x * (2.0 ** (149 + _PRODUCT_LOG2 - 4 * (s % 5)))


@triton.jit
def _int4_row_dot(words, x_cols, row, M, HAS_MINS: tl.constexpr):
    """(sum over s of q_s x[8 w + s] 2^-69, sum over s of x[8 w + s]): [BLOCK_N, BLOCK_K // 8] and [BLOCK_K // 8],
    fp32, for x_cols pointing at x[8 w] of the step's words w in row `row` (0 past M); the second only with mins
    (zeros without). Each product is exact (_PRODUCT_LOG2), and the fma adding it keeps it whole: the sums carry
    no offset to cancel. Each thread keeps its words' eight values to itself: no reduction across threads until
    the end of the kernel."""
    row_ok = tl.full(x_cols.shape, row, tl.int32) < M  # a tensor: the interpreter takes no scalar mask
    xs = _x_by_nibble(x_cols, row_ok)
    words_high = words.to(tl.uint32, bitcast=True) >> 20  # logical: no sign extension to undo
    part = tl.zeros(words.shape, dtype=tl.float32)
    for s in tl.static_range(8):
        part += _nibble_as_subnormal(words, words_high, s) * _scaled_for_nibble(xs[s], s)[None, :]
    x_sum = tl.zeros(x_cols.shape, dtype=tl.float32)
    if HAS_MINS:
        x_sum = _sum_by_word(xs)
    return part, x_sum


@triton.jit(do_not_specialize=["M", "num_k_steps", "num_splits"])
def _int4_gemv_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, final_ptr, lock_ptr, M, N, K, num_k_steps, num_splits,
                      stride_xm, stride_qn, stride_sn, stride_mn, stride_om, stride_split,
                      REDUCE_SPLITS: tl.constexpr, ADD_OUT: tl.constexpr, GROUP_K: tl.constexpr,
                      HAS_MINS: tl.constexpr, TWO_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """4-bit decode of one or two rows (TWO_ROWS) on the CUDA cores: out[:M, n] for BLOCK_N columns over
    num_k_steps K steps of BLOCK_K (BLOCK_K divides the group, the group divides K: no step runs past K).
    Per weight value: an and building its float (a shift per word for three of its eight, _int4_row_dot) and one
    fma per row, the products summed in fp32. No tensor-core operand layout, so the unpacked values never pass
    through shared memory, which costs the dot kernel a 16-bit store and a load per value (~7.5 instructions per
    value in its sm_90 loop). Each step's scale and min apply to the step's per-word sums."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = q_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    acc0 = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.float32)
    k_begin, num_steps = _split_steps(K, num_k_steps, BLOCK_K)
    k_end = k_begin + num_steps * BLOCK_K  # <= K: BLOCK_K divides the group, the group divides K
    words = _step_words(w_rows, n_ok, k_begin, k_end, BLOCK_K)
    for step in range(num_steps):
        k0 = k_begin + step * BLOCK_K
        # the next step's words load while this step's are unpacked (registers, not shared memory: two buffers)
        next_words = _step_words(w_rows, n_ok, k0 + BLOCK_K, k_end, BLOCK_K)
        x_cols = x_ptr + k0 + 8 * tl.arange(0, BLOCK_K // 8)
        # sum(x (q s + mn)) = s 2^69 sum(x q 2^-69) + mn sum(x)
        s, mn = _group_params(s_ptr, m_ptr, offs_n, k0 // GROUP_K, N, stride_sn, stride_mn, 1, HAS_MINS, 0.0)
        s = s * (2.0 ** -_PRODUCT_LOG2)
        part, x_sum = _int4_row_dot(words, x_cols, 0, M, HAS_MINS)
        acc0 += s[:, None] * part  # an fma an element (with mins two), not a multiply, an fma and an add
        if HAS_MINS:
            acc0 += mn[:, None] * x_sum[None, :]
        if TWO_ROWS:
            part, x_sum = _int4_row_dot(words, x_cols + stride_xm, 1, M, HAS_MINS)
            acc1 += s[:, None] * part
            if HAS_MINS:
                acc1 += mn[:, None] * x_sum[None, :]
        words = next_words
    _store_rows(out_ptr, final_ptr, lock_ptr, tl.sum(acc0, axis=1), tl.sum(acc1, axis=1), offs_n, M, N, stride_om,
                num_splits, stride_split, REDUCE_SPLITS, TWO_ROWS, ADD_OUT)


@triton.jit
def _byte_row_dot(acc, q, x_row_ptr, offs_k, row, M, K, step_scale):
    """acc + q * (x * step_scale) for one row: [BLOCK_N, BLOCK_K] fp32, thread-local."""
    ok = (offs_k < K) & (tl.full(offs_k.shape, row, tl.int32) < M)
    x = tl.load(x_row_ptr + offs_k, mask=ok, other=0.0).to(tl.float32) * step_scale
    return acc + q * x[None, :]


@triton.jit(do_not_specialize=["M", "num_k_steps", "num_splits"])
def _byte_gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, final_ptr, lock_ptr, M, N, K, num_k_steps, num_splits, stride_xm,
                     stride_qn, stride_sn, stride_om, stride_split, REDUCE_SPLITS: tl.constexpr,
                     ADD_OUT: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, TWO_ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """8-bit weights without mins (FP8 e4m3, or int8: the 8-bit LM head) at one or two rows (TWO_ROWS) on the CUDA
    cores: out[:M, n] for BLOCK_N columns over num_k_steps K steps of BLOCK_K. Per weight value: a conversion (from
    e4m3 two values per instruction to fp16, then one to fp32; from int8 one, at a quarter of the fma rate, which
    still converts ~3.7e12 values a second on an H100, above its copy bandwidth in bytes) and one fma per row, no
    shared memory. The scales never touch a weight value: with one
    scale column (per-channel, per-tensor) each output column is scaled at the end; with blocks, a program's
    BLOCK_N columns lie in one block row (GROUP_N is a multiple of BLOCK_N) and a step in one block column
    (BLOCK_K divides GROUP_K), so the step's single scale multiplies x (BLOCK_K values, not BLOCK_N x BLOCK_K)."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = q_ptr + offs_n[:, None].to(tl.int64) * stride_qn
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_begin, num_steps = _split_steps(K, num_k_steps, BLOCK_K)
    for step in range(num_steps):
        k0 = k_begin + step * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # no prefetch of the next step into registers here: it took 179 registers a thread where 121 let four
        # programs share an SM, which keeps as many loads in flight
        q = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        step_scale = 1.0
        if GROUP_K < K:
            step_scale = tl.load(s_ptr + (pid_n * BLOCK_N // GROUP_N) * stride_sn + k0 // GROUP_K)
        acc0 = _byte_row_dot(acc0, q, x_ptr, offs_k, 0, M, K, step_scale)
        if TWO_ROWS:
            acc1 = _byte_row_dot(acc1, q, x_ptr + stride_xm, offs_k, 1, M, K, step_scale)
    y0 = tl.sum(acc0, axis=1)
    y1 = tl.sum(acc1, axis=1)
    if GROUP_K >= K:  # one scale column: per output column (per-channel) or one for all (per-tensor)
        col_scale = tl.load(s_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_sn, mask=n_ok, other=0.0)
        y0 = y0 * col_scale
        y1 = y1 * col_scale
    _store_rows(out_ptr, final_ptr, lock_ptr, y0, y1, offs_n, M, N, stride_om, num_splits, stride_split,
                REDUCE_SPLITS, TWO_ROWS, ADD_OUT)
