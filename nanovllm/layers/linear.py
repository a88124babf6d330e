"""Linear layers split across tensor-parallel ranks. Each parameter carries a `weight_loader` that copies its own
shard out of a full Hugging Face tensor."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.distributed import tp_rank, tp_size
from nanovllm.utils.loader import copy_exact


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp_dim: int | None):
        super().__init__()
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank(), tp_size()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def _shard(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        size = loaded.size(dim) // self.tp_size
        return loaded.narrow(dim, self.tp_rank * size, size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if self.tp_dim is not None and (self.tp_dim == 0 or param.dim() > 1):
            loaded = self._shard(loaded, self.tp_dim)
        copy_exact(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size // tp_size(), bias, 0)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int):
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        copy_exact(param.data.narrow(0, offset, size), self._shard(loaded, 0))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its heads of each."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        tp = tp_size()
        self.q_size = num_heads // tp * head_dim
        self.kv_size = num_kv_heads // tp * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str):
        offset, size = {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                        "v": (self.q_size + self.kv_size, self.kv_size)}[shard_id]
        copy_exact(param.data.narrow(0, offset, size), self._shard(loaded, 0))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce.

    With `residual`, the result is added to it in place and returned: rank 0's GEMM reads the residual as its C
    operand (beta = 1), so the add needs no kernel and no extra pass over the activations, and is rounded to the
    dtype once; the other ranks write their partial product into it and the all-reduce adds rank 0's residual once.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size // tp_size(), output_size, bias, 1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            y = F.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        elif self.tp_rank == 0:
            y = residual.addmm_(x, self.weight.t())
            if self.bias is not None:
                y.add_(self.bias)
        else:
            y = torch.mm(x, self.weight.t(), out=residual)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y
