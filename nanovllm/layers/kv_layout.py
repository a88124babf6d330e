"""The bytes of a KV block: its dtype, its scales, and the per-layer views the attention kernels read.

A block holds `block_size` tokens of every layer, K and V, as one contiguous chunk, so that moving a block between
tiers is one copy of `block_bytes` and needs nothing else.

- `kv_cache_dtype="auto"`: the model dtype; the cache is kv[num_blocks, num_layers, 2, block_size, num_kv_heads,
  head_dim].
- FP8 (`"fp8"` = `"fp8_e4m3"`, `"fp8_e5m2"`): the cache is raw bytes, uint8[num_blocks, block_bytes]. Inside a
  block, each (layer, K or V) is one run of `block_size * num_kv_heads * head_dim` FP8 values followed by
  `block_size * num_kv_heads` bfloat16 scales, one per token and kv head: x ~= fp8 * scale, scale = amax / FP8_MAX
  of that token's head vector rounded up to a power of two (quantize_fp8 says why). The scales live inside the
  block, so a block that goes to the host (or disk) and comes back brings them along byte for byte, and a token's
  scale is written once, with its values (a decode step appends tokens to a block without touching the ones before).
  K is stored rotated by a normalised Hadamard matrix H (the kernels rotate q by the same H before q . k; H is
  orthogonal, so scores are unchanged): the rotation spreads the few large channels of K over all channels, which
  is what keeps FP8's 3-bit mantissa from costing accuracy (docs/how_it_works.md, "FP8 KV").
"""
from dataclasses import dataclass

import torch

FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_DTYPE = torch.bfloat16  # fp32's range in 2 bytes: a head_dim-64 block stays >= 1.9x smaller than bf16


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def check_fp8_support(kv_cache_dtype: str, device: torch.device):
    """FP8 conversions in the kernels need compute capability 8.9 (Ada, Hopper) or newer."""
    if kv_cache_dtype == "auto" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU with FP8 support (compute capability 8.9 "
                         f"or newer: Ada, Hopper); {torch.cuda.get_device_name(device)} has "
                         f"{capability[0]}.{capability[1]}; use kv_cache_dtype='auto'")


@dataclass(frozen=True)
class LayerKV:
    """One layer's views: k, v [num_blocks, block_size, num_kv_heads, head_dim]; k_scale, v_scale
    [num_blocks, block_size, num_kv_heads] (None without FP8)."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int  # on this rank
    head_dim: int
    model_dtype: torch.dtype
    kv_cache_dtype: str = "auto"

    @property
    def is_fp8(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the stored K/V values."""
        return FP8_DTYPES[self.kv_cache_dtype] if self.is_fp8 else self.model_dtype

    @property
    def _values_per_run(self) -> int:  # one (layer, K or V) of a block
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def _run_bytes(self) -> int:
        """FP8 values then their scales, one (layer, K or V) of a block."""
        return self._values_per_run + self.block_size * self.num_kv_heads * SCALE_DTYPE.itemsize

    @property
    def block_bytes(self) -> int:
        if self.is_fp8:
            return self.num_layers * 2 * self._run_bytes
        return self.num_layers * 2 * self._values_per_run * self.model_dtype.itemsize

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        """The whole cache. Zeroed on the GPU (cheap there, and a slot never written reads as 0, never as NaN); on
        the CPU left to the OS, whose fresh pages read as zeros and cost memory only once written, so a cache
        sized for a long context costs what the work fills."""
        if self.is_fp8:
            shape, dtype = (num_blocks, self.block_bytes), torch.uint8
        else:
            shape = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
            dtype = self.model_dtype
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        return alloc(shape, dtype=dtype, device=device)

    def layer_views(self, kv: torch.Tensor, layer: int) -> LayerKV:
        if not self.is_fp8:
            return LayerKV(kv[:, layer, 0], kv[:, layer, 1])
        return LayerKV(*(self._values_view(kv, layer, i) for i in (0, 1)),
                       *(self._scales_view(kv, layer, i) for i in (0, 1)))

    def _values_view(self, kv: torch.Tensor, layer: int, k_or_v: int) -> torch.Tensor:
        num_blocks, h, d = kv.size(0), self.num_kv_heads, self.head_dim
        offset = (2 * layer + k_or_v) * self._run_bytes
        return kv.view(self.dtype).as_strided((num_blocks, self.block_size, h, d), (self.block_bytes, h * d, d, 1),
                                              kv.storage_offset() + offset)

    def _scales_view(self, kv: torch.Tensor, layer: int, k_or_v: int) -> torch.Tensor:
        num_blocks, h, item = kv.size(0), self.num_kv_heads, SCALE_DTYPE.itemsize
        offset = ((2 * layer + k_or_v) * self._run_bytes + self._values_per_run) // item
        return kv.view(SCALE_DTYPE).as_strided((num_blocks, self.block_size, h), (self.block_bytes // item, h, 1),
                                               kv.storage_offset() // item + offset)


def hadamard(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Normalised Sylvester-Hadamard matrix [head_dim, head_dim]: symmetric and orthogonal (H @ H = I)."""
    assert head_dim & (head_dim - 1) == 0, f"head_dim={head_dim} is not a power of two (Config checks it)"
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.size(0) < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / head_dim ** 0.5).to(dtype=dtype, device=device)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (values [..., head_dim] in `dtype`, scales [...] bf16), one scale per vector.

    The scale is amax / FP8_MAX rounded up to a power of two. FP8 is a floating-point format: scaling by a power of
    two changes no value's relative rounding error, so the scale's only job is range (no value past FP8_MAX, none
    pushed into the subnormals), and a power of two does it with exact arithmetic: the bytes are one FP8 rounding
    of x, the same in torch and in the Triton store kernels on any platform."""
    limit = fp8_max(dtype)
    amax = x.float().abs().amax(-1).clamp_min(1e-30)
    ratio = (amax / limit).view(torch.int32)
    scale = ((ratio + 0x7FFFFF) & 0x7F800000).view(torch.float32)  # the next power of two, exact
    values = (x.float() / scale[..., None]).clamp(-limit, limit).to(dtype)
    return values, scale.to(SCALE_DTYPE)


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., head_dim] from FP8 values and their per-vector scales."""
    return values.float() * scales.float()[..., None]
