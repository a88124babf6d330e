"""The GPU KV cache: the bytes of one block, how many blocks a memory budget buys, and the block-major tensor with
each layer's views. The runner owns the tensor; this module only says its shape and size."""
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanovllm.config import Config

GiB = 1 << 30


@dataclass(frozen=True)
class KVCacheLayout:
    """kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] on one rank: a block of all layers, K and V,
    is one contiguous chunk, so swapping it is one DMA (the host cache mirrors this layout)."""
    num_layers: int
    block_size: int  # tokens per block
    num_kv_heads: int  # this rank's share
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """One block of all layers, K and V, on this rank."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def allocate(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        return torch.zeros((num_blocks, *self.block_shape()), dtype=self.dtype, device=device)


def layer_views(kv_cache: torch.Tensor, layer_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's K and V: strided views [num_blocks, block_size, num_kv_heads, head_dim] of the one tensor."""
    return kv_cache[:, layer_index, 0], kv_cache[:, layer_index, 1]


def max_useful_blocks(config: Config) -> int:
    """What max_num_seqs sequences of max_model_len tokens could use."""
    blocks_per_seq = (config.max_model_len + config.kvcache_block_size - 1) // config.kvcache_block_size
    return config.max_num_seqs * blocks_per_seq


def num_blocks_for_budget(config: Config, block_bytes: int, device: torch.device,
                          profile_free_bytes: Callable[[], int], num_ranks: int) -> int:
    """GPU blocks from kv_cache_memory_bytes or, on CUDA, a profiling run under gpu_memory_utilization
    (`profile_free_bytes`; on CPU, 25% of available memory, at most 4 GiB); capped by num_kvcache_blocks and by
    max_useful_blocks. With tensor parallelism every rank takes the smallest, so all hold the same block ids."""
    if config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // block_bytes
    elif device.type == "cuda":
        num_blocks = profile_free_bytes() // block_bytes
    else:
        import psutil
        num_blocks = min(4 * GiB, psutil.virtual_memory().available // 4) // block_bytes
    num_blocks = min(num_blocks, max_useful_blocks(config))
    if config.num_kvcache_blocks is not None:  # an explicit cap
        num_blocks = min(num_blocks, config.num_kvcache_blocks)
    if num_ranks > 1:
        t = torch.tensor([int(num_blocks)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        num_blocks = int(t.item())
    if num_blocks < 1:
        if config.kv_cache_memory_bytes is not None:
            hint = f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is less than that; raise it"
        else:
            hint = "raise gpu_memory_utilization or lower max_num_batched_tokens (the profiling run's size)"
        raise ValueError(f"no room for a single KV block of {block_bytes:,} bytes: {hint}")
    return int(num_blocks)
