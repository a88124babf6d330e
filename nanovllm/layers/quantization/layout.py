"""The engine's quantized weight layouts, and their torch reference dequantization.

For a linear layer with N output features and K input features (weight [N, K] as in F.linear), every checkpoint
format is repacked at load into one of two kinds; nothing is dequantized to bf16 at load.

Kind "int": integer groups along K (group size G divides K; for 4 bits G is a multiple of 8)
- bits 4: `qweight` torch.int32 [N, K // 8]. Element (n, k) is the UNSIGNED nibble
  `(qweight[n, k // 8] >> (4 * (k % 8))) & 0xF` (nibble 0 is the least significant; the int32 is read as unsigned
  bits).
- bits 8: `qweight` torch.int8 [N, K], SIGNED -128..127.
- `scales` [N, K // G]: float16, bfloat16 or float32 (whichever holds the checkpoint's values exactly).
- `mins` [N, K // G]: float16, bfloat16 or float32 (chosen independently of scales), or None (symmetric).
- Dequantized weight, float32: `w[n, k] = f32(q[n, k]) * f32(scales[n, k // G])`, then `+ f32(mins[n, k // G])`
  when mins is not None: a multiply then an add, each rounded to float32 (NOT an fma). This matches the `gguf`
  package's numpy dequantization bit for bit.
- Mappings (each exact in float32; formats.py holds the checkpoint ones):
  - AWQ (GEMM): w = (q - z) * s -> 4-bit q, scales = s (fp16), mins = -(z * s) computed in fp32 (stored fp32).
  - GPTQ 4-bit: the same with its zeros (GPTQ's v1 checkpoints store z - 1 in qzeros: add 1 back); symmetric: z = 8.
    GPTQ 8-bit: int8 q_s = q - 128, scales = s, mins = (128 - z) * s in fp32.
  - compressed-tensors pack-quantized W4A16 symmetric: q - 8 -> 4-bit q, scales = s, mins = -8 * s (asymmetric: its
    zero point likewise).
  - GGUF Q4_0: scales = d (fp16), mins = -8 * d (fp16, exact). Q4_1: scales = d, mins = m (fp16). Q4_K: G = 32,
    scales = d * sc (fp32), mins = -(dmin * m) (fp32). Q5_K: 8-bit q (0..31), G = 32, same scale/min rule as Q4_K.
    Q6_K: 8-bit q_s = q - 32, G = 16, scales = d * sc (fp32), mins None. Q8_0: 8-bit q, G = 32, scales = d (fp16),
    mins None.

Kind "fp8"
- `qweight` torch.float8_e4m3fn [N, K]; `scales` float32 [ceil(N / bn), ceil(K / bk)] for a block (bn, bk):
  block FP8 (128, 128) as in Qwen's `*-FP8` checkpoints (`weight_scale_inv`), per-channel (1, K) -> [N, 1],
  per-tensor (N, K) -> [1, 1]. w[n, k] = f32(q[n, k]) * scales[n // bn, k // bk].

Kernel API (nanovllm/kernels/quant_matmul.py)
- `int_linear(x, qweight, scales, mins, bits, group_size) -> y`: x [M, K] bf16/fp16, y [M, N] in x.dtype.
- `fp8_linear(x, qweight, scales, block_size) -> y`: block_size = (bn, bk).
- CUDA only (Triton), registered as torch custom ops so that CUDA graphs and torch.compile take them. Elsewhere the
  layer dequantizes with the reference below (in float32, then cast to the activation's dtype) and calls F.linear.
  Bias and the residual add stay in the layer.
- Shapes tensor parallelism may produce: N and K of a shard; K of a row-parallel shard stays a multiple of G.
"""
import sys

import torch

NIBBLE_SHIFTS = tuple(range(0, 32, 4))  # nibble i of an int32 sits at bits 4i .. 4i + 3


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """[N, K // 8] int32 -> [N, K] uint8 in 0..15 (nibble i of word j is element 8j + i)."""
    if sys.byteorder == "little" and qweight.is_contiguous():
        # byte b of a little-endian word holds its nibbles 2b (low half) and 2b + 1 (high half): two passes over
        # the bytes instead of eight over the words (the CPU engine unpacks every 4-bit weight at every step)
        packed = qweight.view(torch.uint8)  # [N, K // 2]
        return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    nibbles = torch.empty(*qweight.shape, 8, dtype=torch.uint8, device=qweight.device)
    for i, shift in enumerate(NIBBLE_SHIFTS):  # one nibble at a time: 1 byte per value of scratch, not 4
        nibbles[..., i] = (qweight >> shift) & 0xF  # the arithmetic shift's sign bits are masked off
    return nibbles.flatten(-2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> [N, K // 8] int32, the inverse of unpack_int4."""
    if q.size(-1) % 8:
        raise ValueError(f"pack_int4 needs K a multiple of 8, got K={q.size(-1)}")
    packed = torch.zeros(*q.shape[:-1], q.size(-1) // 8, dtype=torch.int32, device=q.device)
    for i, shift in enumerate(NIBBLE_SHIFTS):
        packed |= q[..., i::8].to(torch.int32) << shift  # nibble 7 lands in the sign bit: the same 32 bits
    return packed


def int_values(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The integers q[n, k] of an int-kind weight: 0..15 for 4 bits, -128..127 for 8."""
    if bits == 4:
        return unpack_int4(qweight)
    if bits == 8:
        return qweight
    raise ValueError(f"bits={bits} is not an int layout; supported: 4, 8")


def dequantize_int(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
                   group_size: int) -> torch.Tensor:
    """The reference dequantization of kind "int", float32 [N, K]: q * scale, then + min, each rounded to float32."""
    q = int_values(qweight, bits).to(torch.float32)  # [N, K]
    n, k = q.shape
    w = q.view(n, k // group_size, group_size) * scales.to(torch.float32)[:, :, None]  # the scales broadcast
    if mins is not None:
        w += mins.to(torch.float32)[:, :, None]  # the same two roundings as q * scale + min per element
    return w.view(n, k)


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """The reference dequantization of kind "fp8", float32 [N, K]: q * scales[n // bn, k // bk]."""
    n, k = qweight.shape
    bn, bk = block_size
    per_element = scales.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return qweight.to(torch.float32) * per_element.to(torch.float32)
