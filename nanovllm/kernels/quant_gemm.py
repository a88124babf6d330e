"""Weight-only quantized GEMM in Triton: y[M, N] = x[M, K] @ dequant(W)[N, K].T with 16-bit activations and the
weights read packed (4-bit int, 8-bit int or FP8 e4m3), dequantized in registers, fp32 accumulation. Layouts and
the dequantization formula are docs' shared contract (nanovllm/kernels/quant_matmul.py's docstring).

One kernel serves decode (a few rows, split-K) and prefill (128-row tiles), in two modes that quant_matmul.py's
plans choose by M.

Scale after the dot (SCALE_AFTER_DOT, decode). A K step of BLOCK_K columns lies inside one scale group (BLOCK_K
divides the group), so
    sum_k x[m, k] * (q[n, k] * s[n] + mn[n]) = s[n] * (x @ q)[m, n] + mn[n] * sum_k x[m, k]
and the tensor cores multiply the raw integers: the per-element work is only the unpack (shift, mask, or: three
integer ops per 4-bit value), where dequantizing each element first (convert, multiply, add, round to bf16) takes
about six. On an H100 at 75% of its ~3 TB/s a W4 GEMV unpacks ~4.5e12 values a second, so six ops each would use
most of the SMs' issue rate; three leave room. The raw integers are exact in bf16/fp16 (4-bit: 0..15, 8-bit:
-128..127, e4m3 values too), so the dot is exact products with fp32 sums, and the scale multiplies the fp32
partial once per (row, column, K step): more accurate than rounding each dequantized weight to bf16.
The 4-bit unpack builds the 16-bit float (OFFSET + q) directly from bits: OFFSET_BITS | q is the bf16 128 + q
(0x4300) or the fp16 1024 + q (0x6400), no int-to-float conversion; the OFFSET * sum(x) it adds to the dot is
taken back out with the min term (mn - OFFSET * s), in fp32 (cancellation costs at most ~2^-17 relative).

Dequantize the tile (prefill). At 128 rows the unpack is shared by 128 rows of MACs, so its cost no longer
matters, but a dot whose result is scaled before it is added cannot accumulate in place: on sm_90 Triton keeps
the accumulator and the in-flight wgmma results side by side, and the 128 x 128 tiles spilled (255 registers and
~400 bytes of stack per thread). So each step's tile is dequantized (q * s + mn in fp32, rounded to x's dtype, as
every W4A16 GEMM and the engine's CPU path do) and the dots accumulate in place, as in a bf16 GEMM.

When the group is not a multiple of 16 (tl.dot's smallest K) the kernel gathers a scale and a min per element and
dequantizes in fp32 before the dot (PER_ELEMENT): the contract's formula, any group size, slower.

Split-K (decode). At 1-16 rows a tile of the output is a few KB of weights per program, and N / BLOCK_N programs
(64 for a 4096-wide output at BLOCK_N = 64) cannot keep an H100's 132 SMs' loads in flight. Each of SPLIT_K
programs per output tile takes a slice of K and writes fp32 partial sums [SPLIT_K, M, N]; the last program of the
tile to finish (a counter per tile, _reduce_splits_if_last) sums the slices in a fixed order and rounds to the
output dtype, as Marlin's serial reduction does: no second launch, whose ~2 us between dependent kernels four
linears a layer would pay (the switch split_k_reduce="launch" runs _sum_splits_kernel instead, the same bits).
Chosen over fp32 atomics: the same inputs give the same bits on every run (atomics add in arrival order), no
zero-fill launch, and the partials (at most ~2 MB for 16 rows) stay in L2.

Adding into the output (ADD_OUT, every weight-only kernel). A row-parallel layer adds its product to the residual
stream: with ADD_OUT the output tensor holds the residual, and the kernel writes residual + x @ W.T, the two added in
fp32 and rounded once (as cuBLAS's addmm with beta = 1 does for 16-bit weights), in place of a separate add kernel
after the GEMM (two a layer at decode). Only the result is added, never a split's partial: unsplit, the kernel's own
store adds it (_store_split); split-K, the reduction does (_reduce_splits_if_last, _sum_splits_kernel).
"""
import triton
import triton.language as tl

KIND_INT4, KIND_INT8, KIND_FP8 = 0, 1, 2  # WEIGHT_KIND values


@triton.jit
def _swizzled_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program, GROUP_M row tiles walking the columns together so that the weight tiles
    they share are read from L2 rather than from memory (the ordering of Triton's matmul tutorial)."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _split_steps(K, num_k_steps, BLOCK_K: tl.constexpr):
    """(first K column, K steps) of this program's split: num_k_steps, or fewer in the last split when the splits
    do not divide K's steps evenly. No step starts at or past K, so no load (a scale's, a min's, an unmasked x or
    word) reads past its row or its tensor."""
    split = tl.program_id(1)
    steps_left = tl.cdiv(K, BLOCK_K) - split * num_k_steps
    return split * num_k_steps * BLOCK_K, tl.minimum(num_k_steps, steps_left)


@triton.jit
def _int4_nibbles(q_ptr, stride_qn, offs_n, k0, N, K, BLOCK_K: tl.constexpr):
    """The 4-bit values [BLOCK_N, BLOCK_K] as int32 0..15 (0 past N and K), built without a 3-d tensor: the words
    load as [BLOCK_N, BLOCK_K // 8] (a row's words contiguous), three interleaves repeat each word 8 times along
    K inside the thread that holds it (no exchange between threads), and the shift picks nibble k % 8. The 3-d
    [BLOCK_K // 8, 8, BLOCK_N] unpack before it, reshaped to 2-d, stored the dot operand to shared memory one
    16-bit value at a time (sm_90 PTX) and streamed ~440 GB/s on an H100, where the 8-bit tiles of the same kernel
    did ~1.9 TB/s."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    ok = (offs_n[:, None] < N) & (offs_w[None, :] < K // 8)
    words = tl.load(q_ptr + offs_n[:, None].to(tl.int64) * stride_qn + offs_w[None, :], mask=ok, other=0)
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)
    words = tl.interleave(words, words)  # [BLOCK_N, BLOCK_K]: column k holds word k // 8
    return (words >> (4 * (tl.arange(0, BLOCK_K) % 8))[None, :]) & 0xF


@triton.jit
def _load_weight_tile(q_ptr, stride_qn, offs_n, k0, offs_k, N, K, WEIGHT_KIND: tl.constexpr,
                      AS_DOT_OPERAND: tl.constexpr, OFFSET_BITS: tl.constexpr, DTYPE: tl.constexpr,
                      EMULATE_DOT_FP32: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight tile [BLOCK_K, BLOCK_N] (k rows, n columns); columns past N and rows past K read 0.
    AS_DOT_OPERAND: exact 16-bit floats for the dot, OFFSET + q for 4-bit (built from bits, _int4_nibbles), q
    otherwise. Else the raw values: 4-bit as int32 0..15, int8, e4m3."""
    n_ok = offs_n[None, :] < N
    row = offs_n[None, :].to(tl.int64) * stride_qn
    if WEIGHT_KIND == 0:
        nibbles = _int4_nibbles(q_ptr, stride_qn, offs_n, k0, N, K, BLOCK_K)  # [BLOCK_N, BLOCK_K]
        if AS_DOT_OPERAND:  # narrowed to 16 bits before the transpose (an int32 tile spilled the 128 x 128 tiles)
            nibbles = (nibbles | OFFSET_BITS).to(tl.int16).to(DTYPE, bitcast=True)
        return tl.trans(nibbles)
    q = tl.load(q_ptr + row + offs_k[:, None], mask=n_ok & (offs_k[:, None] < K), other=0.0)
    if AS_DOT_OPERAND:
        if EMULATE_DOT_FP32:
            q = q.to(tl.float32)  # Triton's CPU interpreter casts int8 to bf16 wrongly
        q = q.to(DTYPE)  # exact: |q| <= 128, or an e4m3 value
    return q


@triton.jit
def _group_params(s_ptr, m_ptr, offs_n, kg, N, stride_sn, stride_mn, GROUP_N: tl.constexpr,
                  HAS_MINS: tl.constexpr, OFFSET: tl.constexpr):
    """Scale s and bias (mn - OFFSET * s) [BLOCK_N], fp32, of scale-group column kg for the output columns offs_n."""
    n_ok = offs_n < N
    rows = (offs_n // GROUP_N).to(tl.int64)
    s = tl.load(s_ptr + rows * stride_sn + kg, mask=n_ok, other=0.0).to(tl.float32)
    bias = -OFFSET * s
    if HAS_MINS:
        bias = bias + tl.load(m_ptr + rows * stride_mn + kg, mask=n_ok, other=0.0).to(tl.float32)
    return s, bias


@triton.jit
def _exact_f32(q, WEIGHT_KIND: tl.constexpr):
    """Raw weight values as fp32 without an int-to-float conversion (a quarter-rate instruction on sm_90): the
    float with bits 0x4B000000 | u is 2^23 + u for 0 <= u < 2^23, so one or and one subtraction, both exact."""
    if WEIGHT_KIND == 0:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    elif WEIGHT_KIND == 1:
        return ((q.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    else:
        return q.to(tl.float32)


@triton.jit
def _dequant_tile(q, s_ptr, m_ptr, offs_n, k0, offs_k, N, stride_sn, stride_mn, WEIGHT_KIND: tl.constexpr,
                  GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, HAS_MINS: tl.constexpr, PER_ELEMENT: tl.constexpr):
    """The contract's formula on a [BLOCK_K, BLOCK_N] tile, fp32: q * s (+ mn). The step's K range lies in one
    scale group (one scale per column) unless PER_ELEMENT, where each element gathers its group's."""
    ok = offs_n[None, :] < N
    rows = (offs_n[None, :] // GROUP_N).to(tl.int64)
    if PER_ELEMENT:
        cols = offs_k[:, None] // GROUP_K
    else:
        cols = k0 // GROUP_K
    w = _exact_f32(q, WEIGHT_KIND) * tl.load(s_ptr + rows * stride_sn + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_MINS:
        w = w + tl.load(m_ptr + rows * stride_mn + cols, mask=ok, other=0.0).to(tl.float32)
    return w


@triton.jit
def _store_split(ptrs, y, mask, num_splits, ADD_OUT: tl.constexpr):
    """This program's y (fp32) at ptrs, its split's place in out_ptr[split]: the fp32 partials when split-K, else the
    output in its dtype. ADD_OUT: unsplit, y is the result and ptrs point at the output (split 0), whose old values
    are added to y in fp32 before the one rounding; split, the partial is stored as it is (the reduction adds them)."""
    if ADD_OUT:
        if num_splits == 1:  # at run time: the plan's split count is not a constant of the compiled kernel
            y += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)


# the row count and the K steps per split change from step to step: not specialized on (a multiple of 16, or 1),
# so that a new batch size compiles nothing mid-run
@triton.jit(do_not_specialize=["M", "num_k_steps", "num_splits"])
def _wo_gemm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, final_ptr, lock_ptr, M, N, K, num_k_steps, num_splits,
                    stride_xm, stride_qn, stride_sn, stride_mn, stride_om, stride_split, REDUCE_SPLITS: tl.constexpr,
                    ADD_OUT: tl.constexpr, WEIGHT_KIND: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                    HAS_MINS: tl.constexpr, SCALE_AFTER_DOT: tl.constexpr, PER_ELEMENT: tl.constexpr,
                    OFFSET: tl.constexpr, OFFSET_BITS: tl.constexpr, EMULATE_DOT_FP32: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out[split] (fp32 partials when split-K, else the output in its dtype; ADD_OUT: the result added to the
    output's old values, module docstring) for one [BLOCK_M, BLOCK_N] tile over num_k_steps K steps starting at
    split * num_k_steps * BLOCK_K. SCALE_AFTER_DOT: the raw weights go into the dot and the scales and mins apply
    to its fp32 result (module docstring); else each step's tile is dequantized
    (q * s + mn in fp32, rounded to x's dtype) and the dots accumulate in place. EMULATE_DOT_FP32: Triton's CPU
    interpreter computes bf16 dots wrongly, so its tests run the dot in fp32 (the operands are exact in both)."""
    pid_m, pid_n = _swizzled_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m[:, None] < M
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin, num_steps = _split_steps(K, num_k_steps, BLOCK_K)
    for step in range(num_steps):
        k0 = k_begin + step * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok & (offs_k[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        if SCALE_AFTER_DOT:
            w = _load_weight_tile(q_ptr, stride_qn, offs_n, k0, offs_k, N, K, WEIGHT_KIND, True, OFFSET_BITS, dtype,
                                  EMULATE_DOT_FP32, BLOCK_K, BLOCK_N)
            if EMULATE_DOT_FP32:
                part = tl.dot(x.to(tl.float32), w.to(tl.float32))
            else:
                part = tl.dot(x, w)
            s, bias = _group_params(s_ptr, m_ptr, offs_n, k0 // GROUP_K, N, stride_sn, stride_mn, GROUP_N,
                                    HAS_MINS, OFFSET)
            acc += part * s[None, :]
            if HAS_MINS or OFFSET != 0:
                x_sum = tl.sum(x.to(tl.float32), axis=1)  # [BLOCK_M]
                acc += x_sum[:, None] * bias[None, :]
        else:
            q = _load_weight_tile(q_ptr, stride_qn, offs_n, k0, offs_k, N, K, WEIGHT_KIND, False, OFFSET_BITS, dtype,
                                  EMULATE_DOT_FP32, BLOCK_K, BLOCK_N)
            w = _dequant_tile(q, s_ptr, m_ptr, offs_n, k0, offs_k, N, stride_sn, stride_mn, WEIGHT_KIND, GROUP_N,
                              GROUP_K, HAS_MINS, PER_ELEMENT).to(dtype)
            if EMULATE_DOT_FP32:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(x, w, acc)
    offs = offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    mask = m_ok & (offs_n[None, :] < N)
    _store_split(out_ptr + tl.program_id(1) * stride_split + offs, acc, mask, num_splits, ADD_OUT)
    if REDUCE_SPLITS:
        _reduce_splits_if_last(final_ptr, out_ptr, lock_ptr, tl.program_id(0), offs, mask, num_splits, stride_split,
                               ADD_OUT)


@triton.jit(do_not_specialize=["numel", "num_splits"])
def _sum_splits_kernel(part_ptr, out_ptr, numel, num_splits, ADD_OUT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over splits of part[split] (fp32, splits in order; ADD_OUT: then + out's old values), rounded once
    to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for split in range(num_splits):
        total += tl.load(part_ptr + split * numel + offs, mask=ok, other=0.0)
    if ADD_OUT:
        total += tl.load(out_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _reduce_splits_if_last(out_ptr, part_ptr, lock_ptr, tile_id, offs, mask, num_splits, stride_split,
                           ADD_OUT: tl.constexpr):
    """Split-K without a second launch: after this program's partial is stored, the last of the tile's num_splits
    programs to arrive (a counter per tile, lock_ptr[tile_id]) sums the tile's partials in split order (ADD_OUT:
    then adds out_ptr's old values), exactly as _sum_splits_kernel does (the same bits), writes out_ptr, and resets
    the counter to 0 for the next launch.
    NOTE: the barrier orders every thread's partial before the count (a release at GPU scope is cumulative), the
    acquire orders the last program's reads after all counts, and its reads skip L1 (.cg), which is not coherent
    across SMs. Kernels on one stream never overlap, so one counter array serves every launch."""
    tl.debug_barrier()
    arrived = tl.atomic_add(lock_ptr + tile_id, 1, sem="acq_rel")
    if arrived == num_splits - 1:
        total = tl.load(part_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        for split in range(1, num_splits):
            total += tl.load(part_ptr + split * stride_split + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if ADD_OUT:  # no program of the launch writes out_ptr before this one
            total += tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(lock_ptr + tile_id, 0)


@triton.jit
def _store_rows(out_ptr, final_ptr, lock_ptr, y0, y1, offs_n, M, N, stride_om, num_splits, stride_split,
                REDUCE_SPLITS: tl.constexpr, TWO_ROWS: tl.constexpr, ADD_OUT: tl.constexpr):
    """The CUDA-core kernels' one or two output rows [BLOCK_N] into out_ptr[split] (partials or the output;
    ADD_OUT: _store_split), then the split-K reduction in the last program of the column tile (REDUCE_SPLITS)."""
    n_ok = offs_n < N
    out = out_ptr + tl.program_id(1) * stride_split + offs_n
    _store_split(out, y0, n_ok, num_splits, ADD_OUT)
    if TWO_ROWS:
        _store_split(out + stride_om, y1, n_ok & (tl.full(offs_n.shape, 1, tl.int32) < M), num_splits, ADD_OUT)
    if REDUCE_SPLITS:
        rows = tl.arange(0, 2)
        offs = offs_n[:, None] + rows[None, :] * stride_om  # [BLOCK_N, 2]
        mask = (offs_n[:, None] < N) & (rows[None, :] < M)
        _reduce_splits_if_last(final_ptr, out_ptr, lock_ptr, tl.program_id(0), offs, mask, num_splits, stride_split,
                               ADD_OUT)
