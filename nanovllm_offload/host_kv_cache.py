"""The host tensors of the swap tier: one pinned block pool that mirrors the GPU cache block for block."""
import torch


class HostKVCache:
    """kv[num_cpu_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], the GPU layout with cpu_block_ids.

    Block-major like the GPU cache, so one block (all layers, K and V) is one contiguous chunk: one DMA per block,
    one per run of consecutive ids. Pinned on CUDA machines so copies are asynchronous and run at link speed.
    """

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool):
        self.kv = torch.empty((num_blocks, *block_shape), dtype=dtype, device="cpu", pin_memory=pin_memory)

    @property
    def num_blocks(self) -> int:
        return self.kv.size(0)
