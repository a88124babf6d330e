"""Each checkpoint format's tensors for one linear layer, and their repacking into the engine's layout (layout.py).

The checkpoint's own tensors are the layer's parameters while it loads (as in vLLM), so tensor parallelism shards
them with the same code as bf16 weights; `to_layout` then turns them into the layout, exactly (no rounding).

Published packings (N outputs, K inputs, G group size, pf = 32 // bits values per int32):
- AWQ GEMM (AutoAWQ): qweight int32 [K, N // 8] and qzeros int32 [K // G, N // 8] hold 8 outputs per word in the
  interleaved order AWQ_ORDER (nibble i holds output 8j + AWQ_ORDER[i]); scales fp16 [K // G, N]; w = (q - z) * s.
- GPTQ (AutoGPTQ, GPTQModel): qweight int32 [K // pf, N] packs along K, value i of a word at bits (bits * i);
  qzeros int32 [K // G, N // pf] packs along N likewise and holds z - 1 (format "gptq", v1) or z ("gptq_v2");
  scales fp16 [K // G, N]; g_idx int32 [K] (without act-order: k // G); w = (q - z) * s.
- compressed-tensors pack-quantized: weight_packed int32 [N, K // pf] packs along K, value i at bits (bits * i),
  each stored as q + 2**(bits - 1) (unsigned); weight_scale [N, K // G]; asymmetric: weight_zero_point int32
  [N // pf, K // G] packed along N the same way; weight_shape [2] = (N, K); w = (q - zp) * s.
- "layout" (no checkpoint format: what a loader that repacks by itself, GGUF's, hands over): qweight, scales and
  mins exactly as layout.py holds them.
- FP8: weight float8_e4m3fn [N, K]; block scales weight_scale_inv (fp8 method) or weight_scale (compressed-tensors
  block strategy) float32 [ceil(N / bn), ceil(K / bk)]; per channel weight_scale [N, 1]; per tensor a scalar
  weight_scale (expanded to a scale per row: a merged layer's parts may have different ones).
"""
from dataclasses import dataclass

import torch

from nanovllm.layers.quantization.layout import pack_int4
from nanovllm.utils.quant_spec import QuantSpec

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i of a word holds output 8j + AWQ_ORDER[i]
AWQ_UNDO_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # output 8j + c is nibble AWQ_UNDO_ORDER[c]


@dataclass(frozen=True)
class CheckpointTensor:
    """One checkpoint tensor of a layer, as the layer's parameter while it loads. `out` / `inn` = (dim, divisor):
    the dimension that runs along the layer's outputs / inputs and how many features one element spans there."""
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    out: tuple[int, int] | None
    inn: tuple[int, int] | None
    is_optional: bool = False  # a checkpoint may leave it out

    @property
    def shard_dims(self) -> tuple[tuple[int, str, int], ...]:
        """((dim, "out" | "in", divisor), ...) as linear.py's weight loader reads them."""
        dims = []
        if self.out:
            dims.append((self.out[0], "out", self.out[1]))
        if self.inn:
            dims.append((self.inn[0], "in", self.inn[1]))
        return tuple(dims)


def checkpoint_tensors(spec: QuantSpec, output_size: int, input_size: int) -> list[CheckpointTensor]:
    """The tensors of one layer with output_size x input_size (this rank's shard) in the spec's format. Scales
    load as float32 (exact from fp16/bf16) and become the narrowest exact dtype in to_layout."""
    n, k, f32, i32 = output_size, input_size, torch.float32, torch.int32
    if spec.kind == "fp8":
        bn, bk = spec.block_size or (1, k)
        scale = "weight_scale_inv" if spec.method == "fp8" and spec.block_size else "weight_scale"
        scale_shape = (-(-n // bn), -(-k // bk)) if spec.block_size else (n, 1)
        return [CheckpointTensor("weight", (n, k), torch.float8_e4m3fn, (0, 1), (1, 1)),
                CheckpointTensor(scale, scale_shape, f32, (0, bn), (1, bk) if spec.block_size else None)]
    g, pf = spec.group_size_for(k), 32 // spec.bits
    if spec.method == "awq":
        return [CheckpointTensor("qweight", (k, n // 8), i32, (1, 8), (0, 1)),
                CheckpointTensor("qzeros", (k // g, n // 8), i32, (1, 8), (0, g)),
                CheckpointTensor("scales", (k // g, n), f32, (1, 1), (0, g))]
    if spec.method == "layout":  # already the layout: layout.py
        qweight = CheckpointTensor("qweight", (n, k // 8) if spec.bits == 4 else (n, k),
                                   i32 if spec.bits == 4 else torch.int8, (0, 1), (1, 8 if spec.bits == 4 else 1))
        groups = [CheckpointTensor(name, (n, k // g), f32, (0, 1), (1, g))
                  for name in ("scales", "mins")[:1 + spec.has_zero_point]]
        return [qweight, *groups]
    if spec.method == "gptq":
        return [CheckpointTensor("qweight", (k // pf, n), i32, (1, 1), (0, pf)),
                CheckpointTensor("qzeros", (k // g, n // pf), i32, (1, pf), (0, g)),
                CheckpointTensor("scales", (k // g, n), f32, (1, 1), (0, g)),
                CheckpointTensor("g_idx", (0,), i32, None, None, is_optional=True)]
    tensors = [CheckpointTensor("weight_packed", (n, k // pf), i32, (0, 1), (1, pf)),
               CheckpointTensor("weight_scale", (n, k // g), f32, (0, 1), (1, g)),
               CheckpointTensor("weight_shape", (0,), torch.int64, None, None)]
    if spec.has_zero_point:
        tensors.append(CheckpointTensor("weight_zero_point", (n // pf, k // g), i32, (0, pf), (1, g)))
    return tensors


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W * (32 // bits)]: value i of word j (at bits bits * i) is element j * pf + i,
    read as unsigned. One value at a time, so the scratch is a byte per value (a layer of Qwen3-8B's MLP has 10**8)."""
    per_word = 32 // bits
    values = torch.empty(*words.shape, per_word, dtype=torch.uint8, device=words.device)
    for i in range(per_word):
        values[..., i] = (words >> (bits * i)) & ((1 << bits) - 1)  # the arithmetic shift's sign bits masked off
    return values.flatten(-2)


def narrowest_exact(scales: torch.Tensor) -> torch.Tensor:
    """float16 or bfloat16 when it holds every value exactly, else float32 (the layout allows all three)."""
    for dtype in (torch.float16, torch.bfloat16):
        narrow = scales.to(dtype)
        if torch.equal(narrow.to(torch.float32), scales) and narrow.isfinite().all():
            return narrow
    return scales


def to_layout(spec: QuantSpec, tensors: dict[str, torch.Tensor], input_size: int) -> dict[str, torch.Tensor | None]:
    """A layer's loaded checkpoint tensors -> the layout's qweight, scales and mins."""
    if spec.kind == "fp8":
        scales = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        return dict(qweight=tensors["weight"], scales=scales.to(torch.float32), mins=None)
    bits = spec.bits
    if spec.method == "layout":
        mins = tensors.get("mins")
        return dict(qweight=tensors["qweight"], scales=narrowest_exact(tensors["scales"]),
                    mins=None if mins is None else narrowest_exact(mins))
    if spec.method == "awq":
        q = unpack_words(tensors["qweight"], 4).unflatten(-1, (-1, 8))[..., AWQ_UNDO_ORDER].flatten(-2).t()
        zeros = unpack_words(tensors["qzeros"], 4).unflatten(-1, (-1, 8))[..., AWQ_UNDO_ORDER].flatten(-2).t()
        scales = tensors["scales"].t()  # [N, K // G]
    elif spec.method == "gptq":
        q = unpack_words(tensors["qweight"].t(), bits)  # [N, K]
        zeros = unpack_words(tensors["qzeros"], bits).t().to(torch.int32) + spec.zero_offset  # [N, K // G]
        scales = tensors["scales"].t()
    else:  # compressed-tensors: stored unsigned; its zero point in the same unsigned form (2**(bits-1) if symmetric)
        q = unpack_words(tensors["weight_packed"], bits)
        zeros = unpack_words(tensors["weight_zero_point"].t(), bits).t() if spec.has_zero_point else None
        scales = tensors["weight_scale"]
        if zeros is None:
            zeros = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    zeros = zeros.to(torch.int32)
    scales = scales.contiguous()
    if bits == 4:
        mins = -(zeros.to(torch.float32) * scales)  # w = q * s - z * s: both terms exact in float32
        return dict(qweight=pack_int4(q), scales=narrowest_exact(scales), mins=narrowest_exact(mins.contiguous()))
    mins = (128 - zeros).to(torch.float32) * scales  # int8 holds q - 128: w = (q - 128) * s + (128 - z) * s
    return dict(qweight=(q.to(torch.int16) - 128).to(torch.int8).contiguous(), scales=narrowest_exact(scales),
                mins=None if spec.method == "compressed-tensors" and not spec.has_zero_point
                else narrowest_exact(mins.contiguous()))
