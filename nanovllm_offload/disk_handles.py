"""The handles of the disk tier's reads and writes in flight (no torch): what DiskStore.poll() hands back."""
import dataclasses

from nanovllm_offload.disk_format import ReadStatus


@dataclasses.dataclass(eq=False, slots=True)
class DiskWrite:
    """One block written (or not: disk full, directory removed). The source buffer is free again once polled."""
    block_hash: int
    is_ok: bool = False


@dataclasses.dataclass(eq=False, slots=True)
class DiskRead:
    """Blocks read into the caller's buffers. statuses[i] says whether buffer i holds block_hashes[i]; a prefix hit
    uses the first `num_leading_ok` of them. Complete once polled."""
    block_hashes: list[int]
    statuses: list[ReadStatus | None]
    num_pending: int
    is_probe: bool = False  # a speed probe: read to be timed, not used (the blocks keep their LRU places)
    first_start_s: float = float("inf")
    last_end_s: float = 0.0

    @property
    def num_ok(self) -> int:
        return sum(s is ReadStatus.OK for s in self.statuses)

    @property
    def num_leading_ok(self) -> int:
        return next((i for i, s in enumerate(self.statuses) if s is not ReadStatus.OK), len(self.statuses))
