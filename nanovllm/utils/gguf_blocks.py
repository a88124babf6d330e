"""GGUF quantized blocks -> the engine's "int" weight layout (docs/quantization.md; the contract lives with
nanovllm/layers/quantization/), without a second rounding.

A GGUF matrix of N rows and K columns is N rows of K / block_size blocks, each block a fixed number of bytes. Each
function below reads one block type's published layout (ggml-common.h) into integer codes q [N, K] plus per-group
scales (and mins): the float32 weight is `q * scales + mins` (a multiply, then an add, each rounded to float32), which
is what the `gguf` package's numpy dequantization computes, bit for bit:

    type   bits  group  q                    scales            mins
    Q4_0   4     32     0..15                d (fp16)          -8 * d (fp16 when exact, else fp32)
    Q4_1   4     32     0..15                d (fp16)          m (fp16)
    Q8_0   8     32     -128..127            d (fp16)          None
    Q4_K   4     32     0..15                d * sc (fp32)     -(dmin * m) (fp32)
    Q5_K   8     32     0..31                d * sc (fp32)     -(dmin * m) (fp32)
    Q6_K   8     16     q - 32: -32..31      d * sc (fp32)     None

Q4_0's `d * (q - 8)` equals `q * d + (-8 * d)` exactly: both products and the sum need at most 15 significant bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256  # the K-quants' super-block
# block type name -> (elements per block, bytes per block), as in gguf.GGML_QUANT_SIZES
BLOCK_SIZES = {
    "Q4_0": (32, 2 + 16),
    "Q4_1": (32, 2 + 2 + 16),
    "Q8_0": (32, 2 + 32),
    "Q4_K": (QK_K, 2 + 2 + 12 + QK_K // 2),
    "Q5_K": (QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),
    "Q6_K": (QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
}


@dataclass
class IntGroups:
    """One weight matrix in the engine's "int" layout: w[n, k] = f32(q[n, k]) * scales[n, k // group_size]
    (+ mins[n, k // group_size])."""
    qweight: torch.Tensor  # bits 4: int32 [N, K // 8], nibble k % 8 of word k // 8; bits 8: int8 [N, K]
    scales: torch.Tensor  # [N, K // group_size], float16 or float32
    mins: torch.Tensor | None  # like scales, or None (symmetric)
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight it stands for."""
        return self.scales.size(0), self.scales.size(1) * self.group_size


def unpack_blocks(raw: np.ndarray, type_name: str) -> IntGroups:
    """raw: uint8 [N, K / block_size * block_bytes], the rows of one GGUF tensor of type `type_name`."""
    if type_name not in BLOCK_SIZES:
        raise ValueError(f"GGUF type {type_name} is not supported as a quantized weight; supported: "
                         f"{list(BLOCK_SIZES)}")
    block_size, block_bytes = BLOCK_SIZES[type_name]
    num_rows = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % block_bytes:
        raise ValueError(f"GGUF {type_name} rows of {raw.shape[1:]} bytes are not whole blocks of {block_bytes}")
    num_blocks = raw.shape[1] // block_bytes
    blocks = np.ascontiguousarray(raw).reshape(num_rows * num_blocks, block_bytes)
    q, scales, mins, bits, group_size = _UNPACK[type_name](blocks)
    num_cols = num_blocks * block_size
    q = q.reshape(num_rows, num_cols)
    scales = scales.reshape(num_rows, num_cols // group_size)
    mins = None if mins is None else mins.reshape(num_rows, num_cols // group_size)
    qweight = torch.from_numpy(pack_nibbles(q)) if bits == 4 else torch.from_numpy(q.astype(np.int8))
    return IntGroups(qweight, torch.from_numpy(scales), None if mins is None else torch.from_numpy(mins),
                     bits, group_size)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 [N, K] -> int32 [N, K // 8], code k at bits 4 * (k % 8) of word k // 8."""
    shifts = (4 * np.arange(8, dtype=np.uint32)).reshape(1, 1, 8)
    words = (q.reshape(q.shape[0], -1, 8).astype(np.uint32) << shifts).sum(axis=-1, dtype=np.uint32)
    return words.view(np.int32)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte `start` of each block, as [num_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Bytes in runs of `run`: each run holds 2 * run codes, the low nibbles first, then the high ones."""
    qs = qs.reshape(qs.shape[0], -1, 1, run)
    return ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF).reshape(qs.shape[0], -1)


def _exact_f16(values: np.ndarray) -> np.ndarray:
    """float32 values as float16 when that keeps every one of them, else float32."""
    as_f16 = values.astype(np.float16)
    return as_f16 if np.array_equal(as_f16.astype(np.float32), values) else values


def _q4_0(blocks):
    d = _f16(blocks, 0)
    mins = _exact_f16(np.float32(-8) * d.astype(np.float32))
    return _nibbles(blocks[:, 2:], 16), d, mins, 4, 32


def _q4_1(blocks):
    return _nibbles(blocks[:, 4:], 16), _f16(blocks, 0), _f16(blocks, 2), 4, 32


def _q8_0(blocks):
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _f16(blocks, 0), None, 8, 32


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K/Q5_K super-block from its 12 bytes (get_scale_min_k4)."""
    low, high, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([low & 63, (extra & 0xF) | ((low >> 6) << 4)], axis=1)
    m = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=1)
    return sc, m


def _k_affine(blocks) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: per group of 32, scales d * sc and mins -(dmin * m), each exact in float32."""
    d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
    sc, m = _k_scale_min(blocks[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q4_k(blocks):
    scales, mins = _k_affine(blocks)
    return _nibbles(blocks[:, 16:], 32), scales, mins, 4, 32


def _q5_k(blocks):
    scales, mins = _k_affine(blocks)
    qh = blocks[:, 16:48]  # bit j of qh[i] is the fifth bit of code 32 * j + i
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = _nibbles(blocks[:, 48:], 32) | (high.reshape(-1, QK_K) << 4)
    return q, scales, mins, 8, 32


def _q6_k(blocks):
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks, 208).astype(np.float32)
    # each half of 128 codes: ql's 64 bytes give the low 4 bits (low nibbles, then high), qh's 32 bytes the top 2
    # bits of codes i, 32 + i, 64 + i, 96 + i at bit pairs 0, 2, 4, 6 of byte i
    low = _nibbles(ql, 64)
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(-1, QK_K) << 4)).astype(np.int8) - np.int8(32)
    return q, d * scales, None, 8, 16


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
