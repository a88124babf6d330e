"""The linear method a linear layer delegates its weights to (vLLM's quant_method): it creates the layer's
parameters with the facts their loader needs to shard them, turns loaded checkpoint tensors into the layout once
loading ends, fills dummy weights, and runs the matmul.

A layer's parameters while it loads are its checkpoint's own tensors (formats.py), each tagged `shard_dims`:
((dim, "out" | "in", divisor), ...), the dimensions that run along the layer's outputs or inputs and how many
features one element spans there (8 for an int32 of 4-bit values, G for a group's scale). After
`process_weights_after_loading` the layer holds qweight, scales and mins (layout.py) and nothing else of its weight.
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.quantization.formats import checkpoint_tensors, to_layout
from nanovllm.layers.quantization.layout import dequantize_fp8, dequantize_int, pack_int4
from nanovllm.utils.quant_spec import QuantSpec

try:  # the CUDA kernels (Triton); without them CUDA runs the reference below, as the CPU does
    from nanovllm.kernels import quant_matmul
except ImportError:
    quant_matmul = None
KERNEL_DTYPES = (torch.bfloat16, torch.float16)  # the activations the kernels take (float32 runs the reference)


def use_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda and quant_matmul is not None and x.dtype in KERNEL_DTYPES


def new_param(shape, dtype, shard_dims=()) -> nn.Parameter:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.shard_dims = shard_dims
    return param


class UnquantizedLinearMethod:
    """A weight [N, K] in the model's dtype."""
    is_quantized = False

    def create_weights(self, layer: nn.Module):
        layer.weight = new_param((layer.output_size, layer.input_size), torch.get_default_dtype(),
                                 ((0, "out", 1), (1, "in", 1)))

    def process_weights_after_loading(self, layer: nn.Module):
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class QuantLinearMethod:
    """Weights in a layout of layout.py, loaded from the checkpoint format of `spec`."""
    is_quantized = True

    def __init__(self, spec: QuantSpec):
        self.spec = spec

    def create_weights(self, layer: nn.Module):
        spec = self.spec
        layer.bits = spec.bits
        layer.group_size = spec.group_size_for(layer.input_size) if spec.kind == "int" else None
        layer.block_size = (spec.block_size or (1, layer.input_size)) if spec.kind == "fp8" else None
        layer.checkpoint_names = []
        for t in checkpoint_tensors(spec, layer.output_size, layer.input_size):
            param = new_param(t.shape, t.dtype, t.shard_dims)
            param.load_hook = LOAD_HOOKS.get(t.name)
            param.is_optional = t.is_optional
            setattr(layer, t.name, param)
            layer.checkpoint_names.append(t.name)

    def process_weights_after_loading(self, layer: nn.Module):
        tensors = {name: getattr(layer, name).data for name in layer.checkpoint_names}
        self._set_layout(layer, **to_layout(self.spec, tensors, layer.input_size))

    def init_dummy(self, layer: nn.Module, generator: torch.Generator):
        """Random weights in the layout, of about the spread of the unquantized dummy init (normal, std 0.02)."""
        n, k, device = layer.output_size, layer.input_size, getattr(layer, layer.checkpoint_names[0]).device
        if self.spec.kind == "fp8":
            bn, bk = layer.block_size
            q = torch.randn(n, k, generator=generator, device=device).to(torch.float8_e4m3fn)
            scales = torch.full((-(-n // bn), -(-k // bk)), 0.02, device=device)
            return self._set_layout(layer, q, scales, None)
        groups, high = k // layer.group_size, 1 << layer.bits
        q = torch.randint(0, high, (n, k), generator=generator, device=device)  # uniform: std high / sqrt(12)
        scales = torch.full((n, groups), 0.02 * 12 ** 0.5 / high, device=device, dtype=torch.float16)
        if layer.bits == 4:
            return self._set_layout(layer, pack_int4(q), scales, -8 * scales.float())
        self._set_layout(layer, (q - 128).to(torch.int8), scales, None)

    def _set_layout(self, layer: nn.Module, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None):
        for name in layer.checkpoint_names:
            delattr(layer, name)
        layer.checkpoint_names = []
        layer.qweight = new_param(qweight.shape, qweight.dtype)
        layer.qweight.data = qweight
        layer.scales = new_param(scales.shape, scales.dtype)
        layer.scales.data = scales
        if mins is None:
            layer.register_parameter("mins", None)
        else:
            layer.mins = new_param(mins.shape, mins.dtype)
            layer.mins.data = mins

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
        """y [..., N] = x [..., K] @ W.T (+ bias). With residual [..., N]: y added to it in place and residual
        returned; on the kernels' path without a bias the kernel adds it in its epilogue (rounded once, no add
        kernel; quant_matmul.int_linear's residual)."""
        if residual is not None and bias is None and use_kernels(x):
            return self._kernel_linear(layer, x, residual)
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [M, K]
        if use_kernels(x):
            y = self._kernel_linear(layer, x)
        else:
            y = F.linear(x, self.dequantize(layer).to(x.dtype))
        if bias is not None:
            y = y + bias
        y = y.reshape(*shape[:-1], y.size(-1))
        return y if residual is None else residual.add_(y)

    def _kernel_linear(self, layer: nn.Module, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.spec.kind == "fp8":
            return quant_matmul.fp8_linear(x, layer.qweight, layer.scales, layer.block_size, residual)
        return quant_matmul.int_linear(x, layer.qweight, layer.scales, layer.mins, layer.bits, layer.group_size,
                                       residual)

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The layer's weight [N, K] in float32 (layout.py's reference)."""
        if self.spec.kind == "fp8":
            return dequantize_fp8(layer.qweight, layer.scales, layer.block_size)
        return dequantize_int(layer.qweight, layer.scales, layer.mins, layer.bits, layer.group_size)


def _check_g_idx(layer: nn.Module, loaded: torch.Tensor, full_input_size: int) -> None:
    """GPTQ's g_idx without act-order is k // G; k // G' for another group size G' is a config that names the wrong
    one, any other order act-order (desc_act), which is refused."""
    k = torch.arange(full_input_size, device=loaded.device)
    if loaded.shape == k.shape and torch.equal(loaded.to(k.dtype), k // layer.group_size):
        return None
    counts = torch.bincount(loaded.to(torch.int64)) if loaded.shape == k.shape and loaded.min() >= 0 else None
    implied = int(counts[0]) if counts is not None and len(counts) else 0
    if implied and torch.equal(loaded.to(k.dtype), k // implied):
        raise ValueError(f"g_idx groups every {implied} inputs, but quantization_config.group_size="
                         f"{layer.group_size}; the config names the wrong group size")
    raise ValueError(f"g_idx of shape {tuple(loaded.shape)} is not k // group_size for k < {full_input_size} "
                     f"(act-order groups, desc_act=true, are not supported)")


def _check_weight_shape(layer: nn.Module, loaded: torch.Tensor, full_shape: tuple[int, int]) -> None:
    if tuple(loaded.tolist()) != full_shape:
        raise ValueError(f"weight_shape {loaded.tolist()} does not match the layer's {list(full_shape)}")
    return None


def _expand_per_tensor(layer: nn.Module, loaded: torch.Tensor, full_shape: tuple[int, int]) -> torch.Tensor:
    """A per-tensor FP8 scale becomes a scale per row (each merged part keeps its own)."""
    if loaded.numel() == 1 and layer.block_size == (1, layer.input_size):
        return loaded.reshape(1, 1).expand(full_shape[0], 1)
    return loaded


def _finite(layer: nn.Module, loaded: torch.Tensor, full_shape: tuple[int, int]) -> torch.Tensor:
    """A NaN or infinite scale would make its whole group's outputs NaN: a corrupt checkpoint, refused (the loader
    names the tensor)."""
    if loaded.is_floating_point() and not torch.isfinite(loaded).all():
        raise ValueError(f"{int((~torch.isfinite(loaded)).sum())} of its values are NaN or infinite")
    return loaded


# checkpoint tensor name -> fn(layer, loaded, (outputs, inputs) of the loaded tensor's part) -> the tensor to shard
# and copy, or None (checked, nothing to keep)
LOAD_HOOKS = {"g_idx": lambda layer, loaded, shape: _check_g_idx(layer, loaded, shape[1]),
              "weight_shape": _check_weight_shape,
              "weight_scale": lambda layer, loaded, shape: _expand_per_tensor(layer, _finite(layer, loaded, shape),
                                                                              shape),
              "weight_scale_inv": _finite, "scales": _finite, "mins": _finite}
