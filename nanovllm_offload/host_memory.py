"""How many host blocks swap_space buys, and whether the host can hold them (plain Python; no torch)."""
import logging

import psutil

logger = logging.getLogger(__name__)
GiB = 1 << 30


def num_host_blocks(swap_space_gib: float, block_bytes: int) -> int:
    """How many host blocks `swap_space` buys (check_host_memory says whether the host can hold them)."""
    return int(swap_space_gib * GiB) // block_bytes


def check_host_memory(num_bytes: int, num_ranks: int, swap_space_gib: float, pinned: bool):
    """Raises ValueError when every rank's pool does not fit in the host's available memory. A pinned pool counts
    at the size PyTorch's pinned allocator really locks: it rounds a request up to a power of two
    (pytorch/pytorch#95823), so a 40 GiB pool locks 64 GiB; a rounding that locks much more than asked is warned
    about."""
    locked = 1 << max(num_bytes - 1, 0).bit_length() if pinned else num_bytes
    rounded = " (PyTorch rounds pinned allocations up to a power of two)" if locked > num_bytes else ""
    available = psutil.virtual_memory().available
    if locked * num_ranks > 0.9 * available:
        raise ValueError(f"swap_space={swap_space_gib:g} GiB locks {locked / GiB:.1f} GiB of "
                         f"{'pinned ' if pinned else ''}memory per rank x {num_ranks} rank(s){rounded}, but only "
                         f"{available / GiB:.1f} GiB of host memory is available; lower swap_space"
                         f"{', ideally to a power of two' if pinned else ''}")
    if locked > 1.1 * num_bytes:
        logger.warning("swap_space=%g GiB locks %.1f GiB of pinned memory per rank%s: swap_space=%g would use all of "
                       "it", swap_space_gib, locked / GiB, rounded, locked / GiB)
