"""4-bit weights at one row with 8-bit activations on the integer dot-product units (W4A8, opt-in:
quant_matmul.W4_DECODE = "dp4a"), the way llama.cpp's batch-1 kernels reach ~90% of memory bandwidth.

Why: the weight-only CUDA-core kernel (quant_gemm._int4_gemv_kernel) spends ~5.8 instructions per 4-bit value on
sm_90 (a shift, an and-or, an fma, and its share of x's loads, conversions and sums), so at one row it is bound by
instruction issue, not by memory: 1.4 TB/s on an H100 where FP8 weights stream at 2.4. Here a word's 8 nibbles
become two words of 4 bytes with two and-masks and a shift, and `dp4a` multiplies 4 bytes by 4 int8 activations
and adds them into an int32 in one instruction: ~1.4 instructions per value.

The activations are rounded to int8 per 128 columns (scale max|x| / 127, round half away from zero), like
llama.cpp's Q8_1 activations: the error is at most half a step, max|x| / 254 of the group, per value. The mins
term uses the exact fp32 sums of x per 8 columns. So y[n] = sum over steps of s[n, g] * xs[g] * sum(q * xq) +
sum over words of mn[n, g] * xsum[word].

x is packed for dp4a: for word w (columns 8w..8w+7) the low nibbles of its 4 bytes are columns 8w, 8w+2, 8w+4,
8w+6 and the high nibbles 8w+1, 8w+3, 8w+5, 8w+7, so xq[2w] packs the int8 activations of the even columns and
xq[2w + 1] those of the odd ones, byte i holding column 8w + 2i (+ 1).
"""
import triton
import triton.language as tl

from nanovllm.kernels.quant_gemm import _reduce_splits_if_last, _split_steps

X_GROUP = 128  # activation columns per int8 scale, and the kernel's K step
_INT8_MAX = tl.constexpr(127.0)


@triton.jit
def _quantize_x_int8_kernel(x_ptr, xq_ptr, xs_ptr, xsum_ptr, K, stride_xm, stride_qm, stride_sm, stride_wm,
                            NUM_GROUPS: tl.constexpr):
    """One program per row: x [K] -> xq int32 [K / 4] (packed as the module docstring says), xs fp32 [K / 128]
    (the int8 scale of each 128 columns), xsum fp32 [K / 8] (the exact sum of each 8 columns)."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, NUM_GROUPS)[:, None, None, None]
    w = tl.arange(0, 16)[None, :, None, None]
    i = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 2)[None, None, None, :]
    cols = g * 128 + w * 8 + 2 * i + t  # [G, 16, 4, 2]: group, word, byte, low / high nibble
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.max(tl.abs(x), axis=3), axis=2), axis=1)  # [G]
    scale = tl.maximum(amax, 1e-30) / _INT8_MAX
    v = x / scale[:, None, None, None]
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int32)  # half away from zero, |q| <= 127
    packed = tl.sum((q & 0xFF) << (8 * i), axis=2)  # [G, 16, 2]: disjoint bytes, so the sum is their or
    g3 = tl.arange(0, NUM_GROUPS)[:, None, None]
    w3 = tl.arange(0, 16)[None, :, None]
    slots = g3 * 32 + w3 * 2 + tl.arange(0, 2)[None, None, :]
    tl.store(xq_ptr + row * stride_qm + slots, packed, mask=slots < K // 4)
    groups = tl.arange(0, NUM_GROUPS)
    tl.store(xs_ptr + row * stride_sm + groups, scale, mask=groups * 128 < K)
    words = tl.arange(0, NUM_GROUPS)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(xsum_ptr + row * stride_wm + words, tl.sum(tl.sum(x, axis=3), axis=2), mask=words < K // 8)


@triton.jit
def _dp4a(a, b, c, EMULATE: tl.constexpr):
    """c + the dot product of a's 4 unsigned bytes with b's 4 signed bytes (PTX dp4a.u32.s32); EMULATE: with
    shifts and multiplies, for Triton's CPU interpreter, which runs no inline PTX."""
    if EMULATE:
        for i in tl.static_range(4):
            b_byte = (((b >> (8 * i)) & 0xFF) ^ 0x80) - 0x80  # sign-extended
            c += ((a >> (8 * i)) & 0xFF) * b_byte
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit(do_not_specialize=["num_k_steps", "num_splits"])
def _int4_dp4a_kernel(xq_ptr, xs_ptr, xsum_ptr, q_ptr, s_ptr, m_ptr, out_ptr, final_ptr, lock_ptr, N, K,
                      num_k_steps, num_splits, stride_qn, stride_sn, stride_mn, stride_split,
                      REDUCE_SPLITS: tl.constexpr, HAS_MINS: tl.constexpr, GROUP_K: tl.constexpr,
                      EMULATE: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] for BLOCK_N columns over num_k_steps K steps of 128 (GROUP_K is a multiple of 128). The scales and
    mins load as [BLOCK_N, 16] tiles of one address per row (the words' own layout: no exchange between threads
    inside the loop), and each step's int32 dot products are scaled per word before the fp32 sum."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    offs_w = tl.arange(0, 16)
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    k_begin, num_steps = _split_steps(K, num_k_steps, 128)
    for step in range(num_steps):
        k0 = k_begin + step * 128
        words = tl.load(q_ptr + rows * stride_qn + (k0 // 8 + offs_w)[None, :], mask=n_ok[:, None], other=0)
        x_lo = tl.load(xq_ptr + k0 // 4 + 2 * offs_w)[None, :]
        x_hi = tl.load(xq_ptr + k0 // 4 + 2 * offs_w + 1)[None, :]
        dot = _dp4a(words & 0x0F0F0F0F, tl.broadcast_to(x_lo, words.shape), tl.zeros_like(words), EMULATE)
        dot = _dp4a((words >> 4) & 0x0F0F0F0F, tl.broadcast_to(x_hi, words.shape), dot, EMULATE)
        kg = k0 // GROUP_K
        one_per_row = rows * 0 + offs_w[None, :] * 0  # [BLOCK_N, 16] zeros: the scale tile's shape
        s = tl.load(s_ptr + rows * stride_sn + kg + one_per_row, mask=n_ok[:, None], other=0.0).to(tl.float32)
        acc += dot.to(tl.float32) * (s * tl.load(xs_ptr + k0 // 128))
        if HAS_MINS:
            mn = tl.load(m_ptr + rows * stride_mn + kg + one_per_row, mask=n_ok[:, None], other=0.0).to(tl.float32)
            acc += mn * tl.load(xsum_ptr + k0 // 8 + offs_w)[None, :]
    y = tl.sum(acc, axis=1)
    split = tl.program_id(1)
    tl.store(out_ptr + split * stride_split + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    if REDUCE_SPLITS:
        _reduce_splits_if_last(final_ptr, out_ptr, lock_ptr, pid_n, offs_n, n_ok, num_splits, stride_split)
