"""How many host blocks swap_space buys, and whether the host can hold them (plain Python; no torch)."""
import psutil

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
