"""Linear layers split across tensor-parallel ranks. A layer's weight belongs to its linear method
(layers/quantization/method.py: the model's dtype, or a quantized layout); every parameter loads through the layer's
`weight_loader`, which copies this rank's shard out of a full checkpoint tensor.

Each parameter carries `shard_dims`: ((dim, "out" | "in", divisor), ...). Column-parallel layers split the "out"
dimension, row-parallel ones the "in" dimension; a divisor is how many features one element spans there (8 for an
int32 of eight 4-bit values, G for a group's scale), so packed weights split on word and group boundaries.
"""
import torch
import torch.distributed as dist
from torch import nn

from nanovllm.layers.quantization.gguf import gguf_linear_method
from nanovllm.layers.quantization.method import QuantLinearMethod, UnquantizedLinearMethod, new_param
from nanovllm.utils.quant_spec import QuantSpec
from nanovllm.utils.distributed import tp_rank, tp_size
from nanovllm.utils.loader import copy_exact


def linear_method(quant_spec: QuantSpec | None, checkpoint_names: list[str]):
    """The method for a layer made of the checkpoint's linear layers checkpoint_names (q_proj, k_proj, v_proj of
    a qkv_proj): quantized unless the spec leaves them out, which must hold for all of them or none."""
    if quant_spec is None:
        return UnquantizedLinearMethod()
    if quant_spec.method == "gguf":  # each layer's layout from its own tensors' block types
        return gguf_linear_method(quant_spec, checkpoint_names)
    skipped = [quant_spec.is_skipped(name) for name in checkpoint_names]
    if any(skipped) and not all(skipped):
        raise ValueError(f"the checkpoint's quantization_config leaves {checkpoint_names} partly unquantized "
                         f"(modules_to_not_convert / ignore); supported: all parts of a merged layer or none")
    return UnquantizedLinearMethod() if all(skipped) else QuantLinearMethod(quant_spec)


class LinearBase(nn.Module):
    """input_size / output_size are this rank's; output_sizes are the merged parts' (this rank's)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None,
                 quant_spec: QuantSpec | None = None, prefix: str = "", output_sizes: list[int] | None = None,
                 checkpoint_names: list[str] | None = None):
        super().__init__()
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank(), tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_sizes = output_sizes or [output_size]
        self.quant_method = linear_method(quant_spec, checkpoint_names or [prefix])
        self.quant_method.create_weights(self)
        for param in self.parameters(recurse=False):
            param.weight_loader = self.weight_loader
        if bias:
            self.bias = new_param((output_size,), torch.get_default_dtype(), ((0, "out", 1),))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def output_part(self, shard_id) -> tuple[int, int]:
        """(offset, size) of a merged part's outputs on this rank; the whole output without a shard id."""
        return 0, self.output_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None):
        offset, size = self.output_part(shard_id)
        hook = getattr(param, "load_hook", None)
        if hook is not None:
            full = (size * (self.tp_size if self.tp_dim == 0 else 1),
                    self.input_size * (self.tp_size if self.tp_dim == 1 else 1))
            loaded = hook(self, loaded, full)
            if loaded is None:  # checked, nothing to keep
                return
        dst, starts, full_shape = param.data, {}, list(param.shape)
        for dim, axis, div in param.shard_dims:
            if axis == "out":
                length = -(-size // div)
                dst = dst.narrow(dim, offset // div, length)
            else:
                length = dst.size(dim)
            split = (axis == "out" and self.tp_dim == 0) or (axis == "in" and self.tp_dim == 1)
            starts[dim] = (self.tp_rank * length if split else 0, length)
            full_shape[dim] = length * (self.tp_size if split else 1)
        if tuple(loaded.shape) != tuple(full_shape):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's {tuple(full_shape)}")
        for dim, (start, length) in starts.items():
            loaded = loaded.narrow(dim, start, length)
        copy_exact(dst, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_spec: QuantSpec | None = None,
                 prefix: str = "", output_sizes: list[int] | None = None, checkpoint_names: list[str] | None = None):
        tp = tp_size()
        super().__init__(input_size, output_size // tp, bias, 0, quant_spec, prefix,
                         [s // tp for s in output_sizes] if output_sizes else None, checkpoint_names)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj), loaded from the checkpoint's parts
    (shard ids 0, 1, ...; checkpoint_names are their names, for the quantization config's exclusions)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 quant_spec: QuantSpec | None = None, prefix: str = "", checkpoint_names: list[str] | None = None):
        super().__init__(input_size, sum(output_sizes), bias, quant_spec, prefix, output_sizes, checkpoint_names)

    def output_part(self, shard_id) -> tuple[int, int]:
        return sum(self.output_sizes[:shard_id]), self.output_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 quant_spec: QuantSpec | None = None, prefix: str = "", checkpoint_names: list[str] | None = None):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sum(sizes), bias, quant_spec, prefix, sizes, checkpoint_names)
        self.q_size, self.kv_size = self.output_sizes[0], self.output_sizes[1]

    def output_part(self, shard_id) -> tuple[int, int]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    With `residual`, the result is added to it in place and returned: rank 0's GEMM reads the residual as its C
    operand (beta = 1), so the add needs no kernel and no extra pass over the activations, and is rounded to the
    dtype once; the other ranks write their partial product into it and the all-reduce adds rank 0's residual once.
    A quantized weight's kernel does the same on rank 0 where it runs (the weight-only kernels add the residual in
    their epilogue, in fp32, rounded once); elsewhere (the CPU reference, a large-M GEMM) its product is added to
    the residual, and on the other ranks copied into it.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quant_spec: QuantSpec | None = None,
                 prefix: str = ""):
        super().__init__(input_size // tp_size(), output_size, bias, 1, quant_spec, prefix)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        if residual is None:
            y = self.quant_method.apply(self, x, bias)
        elif self.quant_method.is_quantized:
            if self.tp_rank == 0:
                y = self.quant_method.apply(self, x, bias, residual)
            else:
                y = residual.copy_(self.quant_method.apply(self, x, bias))
        elif self.tp_rank == 0:
            y = residual.addmm_(x, self.weight.t())
            if bias is not None:
                y.add_(bias)
        else:
            y = torch.mm(x, self.weight.t(), out=residual)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
