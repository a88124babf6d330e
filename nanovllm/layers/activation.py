import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.compile import compilable


@compilable
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, -1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """silu(gate) * up, for a packed [..., 2 * intermediate] input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
