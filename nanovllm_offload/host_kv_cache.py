"""The host tensors of the swap tier: one pinned block pool that mirrors the GPU cache block for block."""
import logging

import psutil
import torch

logger = logging.getLogger(__name__)
GiB = 1 << 30


def num_host_blocks(swap_space_gib: float, block_bytes: int, num_ranks: int = 1) -> int:
    """How many host blocks `swap_space` buys. Raises ValueError when the host cannot hold it."""
    size_bytes = int(swap_space_gib * GiB)
    available = psutil.virtual_memory().available
    if size_bytes * num_ranks > 0.9 * available:
        raise ValueError(f"swap_space={swap_space_gib:g} GiB x {num_ranks} rank(s) but only "
                         f"{available / GiB:.1f} GiB of host memory is available; lower swap_space")
    return size_bytes // block_bytes


def check_pinned_fits(num_bytes: int, num_ranks: int, swap_space_gib: float):
    """PyTorch's pinned-memory allocator rounds a request up to a power of two (pytorch/pytorch#95823): a 40 GiB
    pool locks 64 GiB of host memory. Raises ValueError when every rank's rounded pool does not fit, and warns when
    the rounding locks much more than swap_space asked for."""
    locked = 1 << max(num_bytes - 1, 0).bit_length()
    available = psutil.virtual_memory().available
    if locked * num_ranks > 0.9 * available:
        raise ValueError(f"swap_space={swap_space_gib:g} GiB locks {locked / GiB:.1f} GiB of pinned memory per rank "
                         f"x {num_ranks} rank(s) (PyTorch rounds pinned allocations up to a power of two), but only "
                         f"{available / GiB:.1f} GiB of host memory is available; lower swap_space, ideally to a "
                         f"power of two")
    if locked > 1.1 * num_bytes:
        logger.warning("swap_space=%g GiB locks %.1f GiB of pinned memory per rank (PyTorch rounds pinned allocations "
                       "up to a power of two): swap_space=%g would use all of it", swap_space_gib, locked / GiB,
                       locked / GiB)


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
