"""How many GPU KV blocks a memory budget buys. The bytes of one block, the block-major tensor and each layer's
views are the KV layout's (nanovllm/layers/kv_layout.py); the runner owns the tensor."""
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanovllm.config import Config

GiB = 1 << 30


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
