import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compilable


@compilable
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a packed [..., 2 * intermediate] input. With a Triton-capable backend the runner sets
    `kernel` to nanovllm.kernels.activation.silu_and_mul (faster than the compiled torch op: docs/benchmarks.md)."""

    def __init__(self):
        super().__init__()
        self.kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x)
        return silu_and_mul(x)
