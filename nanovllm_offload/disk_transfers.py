"""Blocks between the host pool and the disk store, named by cpu_block_id (no torch: the pool is a numpy view).

This runs where the host tensors are (the model runner, on every rank); the host tier decides what moves, in
cpu_block_ids and block hashes, as it does for host<->GPU copies. The runner passes its pinned pool as
`host_kv.view(torch.uint8).view(num_cpu_blocks, -1).numpy()` (numpy has no bfloat16; bytes are bytes).
"""
import dataclasses
from collections import Counter

import numpy as np

from nanovllm_offload.disk_store import DiskRead, DiskStore, DiskWrite


@dataclasses.dataclass(slots=True)
class FinishedLoad:
    """A load that came back: the first num_loaded of cpu_block_ids hold the blocks asked for (the leading run
    that was read whole); the others hold garbage and go back to the pool (their tokens are recomputed)."""
    seq_id: int
    cpu_block_ids: list[int]
    num_loaded: int


class DiskTransfers:
    """Writes and loads in flight, by the host blocks they use.

    NOTE: a host block that a write reads (`writing`) or a load fills (`loading`) must not be handed out or copied
          over until get_finished() has reported it; the host tier holds a reference on it until then.
    """

    def __init__(self, store: DiskStore, host_blocks: np.ndarray):
        if host_blocks.ndim != 2 or host_blocks.shape[1] != store.block_bytes or host_blocks.dtype != np.uint8:
            raise ValueError(f"host_blocks must be a (num_cpu_blocks, {store.block_bytes}) uint8 view of the host "
                             f"pool, got {host_blocks.shape} {host_blocks.dtype}")
        self.store, self.host_blocks = store, host_blocks
        self._writes: dict[DiskWrite, int] = {}  # write -> the cpu_block_id it reads
        self._loads: dict[DiskRead, tuple[int, list[int]]] = {}  # read -> (seq_id, the cpu_block_ids it fills)
        self.writing: Counter[int] = Counter()
        self.loading: set[int] = set()

    def write(self, cpu_block_id: int, block_hash: int) -> bool:
        """Stores a host block on disk (write-back). False when there is nothing to write (stored, or in flight)."""
        handle = self.store.write_async(block_hash, self.host_blocks[cpu_block_id])
        if handle is None:
            return False
        self._writes[handle] = cpu_block_id
        self.writing[cpu_block_id] += 1
        return True

    def load(self, seq_id: int, block_hashes: list[int], cpu_block_ids: list[int]):
        """Reads a disk hit into host blocks the host tier allocated for it."""
        if len(block_hashes) != len(cpu_block_ids):
            raise ValueError(f"seq {seq_id}: {len(block_hashes)} block hashes for {len(cpu_block_ids)} host blocks")
        busy = [b for b in cpu_block_ids if b in self.loading or self.writing[b]]
        if busy:
            raise RuntimeError(f"seq {seq_id}: host blocks {busy} are still in a disk transfer")
        handle = self.store.read_async(block_hashes, [self.host_blocks[b] for b in cpu_block_ids])
        self._loads[handle] = (seq_id, list(cpu_block_ids))
        self.loading.update(cpu_block_ids)

    def get_finished(self) -> tuple[list[int], list[FinishedLoad]]:
        """(cpu_block_ids whose writes finished, loads that finished) since the last call; never blocks."""
        written, loads = [], []
        for handle in self.store.poll():
            if isinstance(handle, DiskWrite):
                cpu_block_id = self._writes.pop(handle)
                self.writing[cpu_block_id] -= 1
                if not self.writing[cpu_block_id]:
                    del self.writing[cpu_block_id]
                written.append(cpu_block_id)
            elif not handle.is_probe:
                seq_id, cpu_block_ids = self._loads.pop(handle)
                self.loading.difference_update(cpu_block_ids)
                loads.append(FinishedLoad(seq_id, cpu_block_ids, handle.num_leading_ok))
        return written, loads

    @property
    def num_in_flight(self) -> int:
        return len(self._writes) + len(self._loads)
