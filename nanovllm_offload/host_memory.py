"""How many host blocks swap_space buys, and whether the host can hold them (plain Python; no torch)."""
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from nanovllm.config import Config

GiB = 1 << 30


def num_host_blocks(swap_space_gib: float, block_bytes: int) -> int:
    """How many host blocks `swap_space` buys (check_host_memory says whether the host can hold them)."""
    return int(swap_space_gib * GiB) // block_bytes


def check_host_memory(num_bytes: int, num_ranks: int, swap_space_gib: float, pinned: bool):
    """Raises ValueError when every rank's pool does not fit in the host's available memory. The pool locks
    exactly num_bytes (HostKVCache registers its own pages rather than asking PyTorch's pinned allocator, which
    rounds up to a power of two)."""
    available = psutil.virtual_memory().available
    if num_bytes * num_ranks > 0.9 * available:
        raise ValueError(f"swap_space={swap_space_gib:g} GiB needs {num_bytes / GiB:.1f} GiB of "
                         f"{'pinned ' if pinned else ''}memory per rank x {num_ranks} rank(s), but only "
                         f"{available / GiB:.1f} GiB of host memory is available; lower swap_space")


def num_host_blocks_for(config: "Config", block_bytes: int) -> int | None:
    """The host pool's size in blocks, or None when the config asks for no host tier. Without the prefix-cache role,
    swapped sequences never hold more than max_num_seqs full-length tables (nothing is admitted while anything is
    swapped), so more host blocks than that would sit idle."""
    if config.swap_space <= 0 or (config.preemption_mode == "recompute" and not config.host_prefix_cache):
        return None
    num_blocks = num_host_blocks(config.swap_space, block_bytes)
    if not config.host_prefix_cache:
        blocks_per_seq = (config.max_model_len + config.kvcache_block_size - 1) // config.kvcache_block_size
        num_blocks = min(num_blocks, config.max_num_seqs * blocks_per_seq)
    return num_blocks
