"""4-bit weight-only decode on the tensor cores with the operands swapped: out.T tile [BLOCK_N, BLOCK_M] =
W tile [BLOCK_N, BLOCK_K] @ x.T [BLOCK_K, BLOCK_M], the scales after the dot (quant_gemm.py's docstring).

Why swapped: quant_gemm._wo_gemm_kernel puts x first ([16, K] @ W.T) and the unpacked weights second, and on
sm_90 a wgmma's second operand must come from shared memory, so every unpacked 16-bit value is stored there and read
back (~7.5 instructions per value in its loop, ~20% of copy bandwidth at 16 rows on an H100). A wgmma's first
operand may sit in registers: with the weights first, the values unpacked in registers can feed the tensor cores
directly, and only x's small [BLOCK_K, 16] tile goes through shared memory. The weight tile is the words' natural
[BLOCK_N, BLOCK_K] layout (quant_gemm._int4_nibbles), with no transpose. BLOCK_N of 64 or more fills a wgmma's 64
rows per warp group. What Triton 3.9 makes of it for sm_90a (the TTGIR and PTX of a 64 x 128 tile): wgmma
m64n16k16 with the weights as the register operand and x by descriptor, where _wo_gemm_kernel's 16-row tiles
compile to mma.sync; but the unpacked tile still goes through shared memory on its way into the operand layout
(16-byte stores, then ldmatrix), and so it did when each value gathered its own word instead (a 32 KB int32 tile
staged by the pipeliner, worse). Whether the async wgmma and the untransposed tile pay at 4-16 rows is the sweep's
to say (benchmarks/sweep_w4.py).
"""
import triton
import triton.language as tl

from nanovllm.kernels.quant_gemm import (_group_params, _int4_nibbles, _reduce_splits_if_last, _split_steps,
                                         _store_split)


# as _wo_gemm_kernel: the row count and the K steps per split are not specialized on
@triton.jit(do_not_specialize=["M", "num_k_steps", "num_splits"])
def _w4_swapped_gemm_kernel(x_ptr, q_ptr, s_ptr, m_ptr, out_ptr, final_ptr, lock_ptr, M, N, K, num_k_steps,
                            num_splits, stride_xm, stride_qn, stride_sn, stride_mn, stride_om, stride_split,
                            REDUCE_SPLITS: tl.constexpr, ADD_OUT: tl.constexpr, GROUP_K: tl.constexpr,
                            HAS_MINS: tl.constexpr, OFFSET: tl.constexpr, OFFSET_BITS: tl.constexpr,
                            EMULATE_DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr):
    """out[split] (fp32 partials when split-K, else the output; ADD_OUT: quant_gemm._store_split) for rows
    pid_m * BLOCK_M.. and columns pid_n * BLOCK_N.. over num_k_steps K steps of BLOCK_K, each inside one scale
    group. The weights enter the dot as the exact 16-bit floats OFFSET + q; per column
    s * dot + (mn - OFFSET * s) * sum(x) (quant_gemm._group_params)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // num_pid_n, tl.program_id(0) % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m[None, :] < M
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_xm  # [1, BLOCK_M]
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_begin, num_steps = _split_steps(K, num_k_steps, BLOCK_K)
    for step in range(num_steps):
        k0 = k_begin + step * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_cols + offs_k[:, None], mask=m_ok, other=0.0)  # [BLOCK_K, BLOCK_M]; no step runs past K
        w = _int4_nibbles(q_ptr, stride_qn, offs_n, k0, N, K, BLOCK_K)  # [BLOCK_N, BLOCK_K] int32 0..15
        w = (w | OFFSET_BITS).to(tl.int16).to(dtype, bitcast=True)  # OFFSET + q, exact
        if EMULATE_DOT_FP32:  # Triton's CPU interpreter computes bf16 dots wrongly; the operands are exact in fp32
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            part = tl.dot(w, xt)  # [BLOCK_N, BLOCK_M]
        s, bias = _group_params(s_ptr, m_ptr, offs_n, k0 // GROUP_K, N, stride_sn, stride_mn, 1, HAS_MINS, OFFSET)
        x_sum = tl.sum(xt.to(tl.float32), axis=0)  # [BLOCK_M]
        acc += part * s[:, None] + bias[:, None] * x_sum[None, :]
    offs = offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]  # [BLOCK_N, BLOCK_M]
    mask = m_ok & (offs_n[:, None] < N)
    _store_split(out_ptr + tl.program_id(1) * stride_split + offs, acc, mask, num_splits, ADD_OUT)
    if REDUCE_SPLITS:
        _reduce_splits_if_last(final_ptr, out_ptr, lock_ptr, tl.program_id(0), offs, mask, num_splits, stride_split,
                               ADD_OUT)
