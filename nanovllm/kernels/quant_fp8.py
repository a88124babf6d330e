"""FP8 x FP8 GEMM for FP8 weights at large M (W8A8): the activations are quantized to e4m3 on the fly, per token
and per group of K columns, and the product runs on FP8 tensor cores (sm_89+), fp32 accumulation.

Why: at 1,024 sequences a Qwen3-8B step is bound by GEMM compute, where FP8 tensor cores do twice the bf16 rate;
a weight-only kernel would only save reading the weights, which is no longer what the step waits for.

Activation scales follow the weights' scale blocks, as in DeepSeek-V3 and vLLM's block-FP8 GEMM:
  - block weights (bn, bk): one activation scale per token and per bk columns, and each K step of BLOCK_K = bk
    columns is one dot whose fp32 result is multiplied by x_scale[m] * w_scale[n // bn] before it is added in;
  - per-channel or per-tensor weights (bk = K): one scale per token; the whole K reduction is one accumulating dot
    and both scales multiply the result once (torch._scaled_mm's rowwise mode does the same, quant_matmul.py may
    call it instead).
e4m3 keeps 3 mantissa bits: each activation is rounded by up to 2^-4 relative, like vLLM's FP8 path.

Tiles (quant_matmul.fp8_w8a8_linear): 128 x 128 x 128 with 8 warps and 4 stages on sm_90 (32 KB of FP8 operands
a stage, 128 KB in all; the accumulator and one scaled dot result take ~220 registers a thread, no spills), as in
vLLM's block-FP8 configs for large M; 64 x 128 with 4 warps and 2 stages where a block gets under 160 KB of shared
memory (sm_89).
"""
import triton
import triton.language as tl

from nanovllm.kernels.quant_gemm import _swizzled_tile

FP8_E4M3_MAX = tl.constexpr(448.0)
_MIN_AMAX = tl.constexpr(1e-12)  # an all-zero group gets a tiny scale, not 0 (its values quantize to 0 either way)


@triton.jit(do_not_specialize=["M"])
def _quantize_act_kernel(x_ptr, xq_ptr, xs_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
                         GROUP: tl.constexpr, GROUPS_PER_CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                         PER_TOKEN: tl.constexpr):
    """One program per row: scale = max|x| / 448 over each group of GROUP columns (or over the whole row,
    PER_TOKEN), xq = x / scale in e4m3 (the division rounded once, as in vLLM's per-token-group quantization).
    The row is read as [GROUPS_PER_CHUNK, GROUP] tiles, NUM_CHUNKS of them: groups are independent, so each tile
    is read once; per token, the largest magnitude needs the whole row first, so a row of several chunks is read
    twice (the second time from L2), and a row of one chunk once. Rows from M on (padding that cuBLASLt's block
    scaling asks for) are written as zeros."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, GROUPS_PER_CHUNK)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GROUP]
    chunk_cols = GROUPS_PER_CHUNK * GROUP
    read_cols = tl.where(row < M, K, 0)  # padding rows read nothing (0): their values and scales come out 0, tiny
    if PER_TOKEN and NUM_CHUNKS == 1:
        x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < read_cols, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), _MIN_AMAX) / FP8_E4M3_MAX
        xq = tl.clamp(x / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
        tl.store(xq_ptr + row * stride_qm + offs, xq.to(xq_ptr.dtype.element_ty), mask=offs < K)
        tl.store(xs_ptr + row * stride_sm, scale)
    elif PER_TOKEN:
        amax = tl.zeros([GROUPS_PER_CHUNK], dtype=tl.float32)
        for chunk in range(NUM_CHUNKS):
            cols = chunk * chunk_cols + offs
            x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < read_cols, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        scale = tl.maximum(tl.max(amax, axis=0), _MIN_AMAX) / FP8_E4M3_MAX
        for chunk in range(NUM_CHUNKS):
            cols = chunk * chunk_cols + offs
            x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < read_cols, other=0.0).to(tl.float32)
            xq = tl.clamp(x / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
            tl.store(xq_ptr + row * stride_qm + cols, xq.to(xq_ptr.dtype.element_ty), mask=cols < K)
        tl.store(xs_ptr + row * stride_sm, scale)
    else:
        for chunk in range(NUM_CHUNKS):
            cols = chunk * chunk_cols + offs
            x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < read_cols, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), _MIN_AMAX) / FP8_E4M3_MAX  # [G]
            xq = tl.clamp(x / scale[:, None], -FP8_E4M3_MAX, FP8_E4M3_MAX)
            tl.store(xq_ptr + row * stride_qm + cols, xq.to(xq_ptr.dtype.element_ty), mask=cols < K)
            groups = chunk * GROUPS_PER_CHUNK + tl.arange(0, GROUPS_PER_CHUNK)
            tl.store(xs_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < K)


@triton.jit(do_not_specialize=["M"])  # a new batch size compiles nothing mid-run
def _fp8_gemm_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_xsm, stride_xsg, stride_wn,
                     stride_wsn, stride_om, GROUP_N: tl.constexpr, PER_STEP_SCALES: tl.constexpr,
                     EMULATE_DOT_FP32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out = (xq * xs) @ (w * ws).T for one [BLOCK_M, BLOCK_N] tile. PER_STEP_SCALES: the scales change every
    BLOCK_K (= the weights' bk) columns, x_scale [M, K / bk] and w_scale [N / bn, K / bk]; otherwise x_scale [M, 1],
    w_scale [N / GROUP_N, 1] applied once at the end. EMULATE_DOT_FP32 is for Triton's CPU interpreter's tests."""
    pid_m, pid_n = _swizzled_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = xq_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    xs_rows = xs_ptr + offs_m.to(tl.int64) * stride_xsm
    ws_rows = ws_ptr + (offs_n // GROUP_N).to(tl.int64) * stride_wsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0)
        w = tl.load(w_cols + offs_k[:, None], mask=n_ok[None, :] & (offs_k[:, None] < K), other=0.0)
        if EMULATE_DOT_FP32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        if PER_STEP_SCALES:
            x_scale = tl.load(xs_rows + (k0 // BLOCK_K) * stride_xsg, mask=m_ok, other=0.0)
            w_scale = tl.load(ws_rows + k0 // BLOCK_K, mask=n_ok, other=0.0)
            acc += tl.dot(x, w) * x_scale[:, None] * w_scale[None, :]
        else:
            acc = tl.dot(x, w, acc)
    if not PER_STEP_SCALES:
        acc = acc * tl.load(xs_rows, mask=m_ok, other=0.0)[:, None] * tl.load(ws_rows, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
