import torch
from torch import nn

from nanovllm.layers.layernorm import rms_norm
from nanovllm.utils.compile import compilable


@compilable
def apply_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor):
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_dim / 2] each

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


@compilable
def qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor):
    """Qwen3's per-head RMSNorm of q and k, then rope: one compiled function, so the four elementwise passes
    become one or two kernels."""
    q, k = rms_norm.fn(q, q_weight, eps), rms_norm.fn(k, k_weight, eps)
    return apply_rope.fn(positions, q, k, cos_sin_cache)


class RotaryEmbedding(nn.Module):
    """The default (NeoX-style, rotate-half) rope with a precomputed cos/sin table over all positions."""

    def __init__(self, head_dim: int, max_position: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, head_dim]
        self.register_buffer("cos_sin_cache", cos_sin.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        return apply_rope(positions, q, k, self.cos_sin_cache)
