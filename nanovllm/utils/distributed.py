"""Tensor-parallel rank and size, valid with or without torch.distributed initialized."""
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def abort_process_group():
    """Abort this process's NCCL communicators, so a collective that a dead rank never joins returns instead of
    waiting for the 10-minute timeout (called from the worker watchdog's thread). gloo needs nothing: a dead peer
    breaks its TCP pairs, and its collectives raise within seconds."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group()
