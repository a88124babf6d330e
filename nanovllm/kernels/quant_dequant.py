"""Dequantize a whole "int" weight (4- or 8-bit groups, the layout contract in quant_matmul.py's docstring) to a
16-bit [N, K] tensor, for the large-M path: dequantize into a scratch tensor, then cuBLAS (F.linear), as vLLM does
for AWQ at large batches. At M ~1024 the GEMM's ~2 M N K flops dwarf the one pass over the weights (a 4-bit
gate_up of Qwen3-8B: 50 MB read and 200 MB written, ~0.1 ms at H100 copy bandwidth, against a 0.27 ms bf16 GEMM),
and cuBLAS runs near the tensor cores' peak where a Triton tile loop that dequantizes in registers did not.

Each program dequantizes a [BLOCK_N, BLOCK_K] tile: its rows' packed words (4-bit: BLOCK_K / 8 int32 a row) or
bytes (8-bit) are contiguous, so each row is one coalesced run of 64-256 bytes, and the output row runs of
BLOCK_K 16-bit values are written contiguously. The formula is the contract's (q * s, then + mn, fp32), rounded
once to the output dtype: the same weights the 128-row tiles of quant_gemm.py feed their dots.
"""
import triton
import triton.language as tl

from nanovllm.kernels.quant_gemm import _exact_f32, _int4_nibbles


@triton.jit
def _repeat8(t):
    """[R, C] -> [R, 8 C], each value 8 times in a row (register-local, as _int4_nibbles repeats its words)."""
    t = tl.interleave(t, t)
    t = tl.interleave(t, t)
    return tl.interleave(t, t)


@triton.jit
def _dequant_int_kernel(q_ptr, s_ptr, m_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_mn, stride_on,
                        WEIGHT_KIND: tl.constexpr, GROUP_K: tl.constexpr, HAS_MINS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[n, k] = q[n, k] * s[n, k // GROUP_K] (+ mn[n, k // GROUP_K]) for one [BLOCK_N, BLOCK_K] tile.
    When GROUP_K is a multiple of 8 (always for 4-bit) each 8 aligned values share a group, and the scales are
    gathered once per 8 values and repeated in registers like _int4_nibbles' words."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n[:, None] < N
    rows = offs_n[:, None].to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    if WEIGHT_KIND == 0:
        q = _int4_nibbles(q_ptr, stride_qn, offs_n, k0, N, K, BLOCK_K)  # [BLOCK_N, BLOCK_K], int32 0..15
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        q = tl.load(q_ptr + rows * stride_qn + offs_k[None, :], mask=n_ok & (offs_k[None, :] < K), other=0)
    w = _exact_f32(q, WEIGHT_KIND)
    if GROUP_K % 8 == 0:  # every 8 aligned values share a group: one scale (and min) load per 8, repeated
        offs_g = k0 + 8 * tl.arange(0, BLOCK_K // 8)
        ok = n_ok & (offs_g[None, :] < K)
        groups = (offs_g // GROUP_K)[None, :]
        w = w * _repeat8(tl.load(s_ptr + rows * stride_sn + groups, mask=ok, other=0.0).to(tl.float32))
        if HAS_MINS:
            w = w + _repeat8(tl.load(m_ptr + rows * stride_mn + groups, mask=ok, other=0.0).to(tl.float32))
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        ok = n_ok & (offs_k[None, :] < K)
        groups = (offs_k // GROUP_K)[None, :]
        w = w * tl.load(s_ptr + rows * stride_sn + groups, mask=ok, other=0.0).to(tl.float32)
        if HAS_MINS:
            w = w + tl.load(m_ptr + rows * stride_mn + groups, mask=ok, other=0.0).to(tl.float32)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + rows * stride_on + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
             mask=n_ok & (offs_k[None, :] < K))
