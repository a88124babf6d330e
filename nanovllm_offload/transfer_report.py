"""What the worker side's transfer handlers tell the manager once per step (plain Python; no torch)."""
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class TransferReport:
    """The one answer to "what completed": CopyEngine.get_finished() builds it, OffloadManager.complete() reads it
    and advances the block states of every transfer it names (vLLM's workers report finished job ids the same way).
    """
    finished_ids: list[int] = field(default_factory=list)  # store_id / load_id of each step's copies that landed
    copies: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds) of the copies timed since
    copy_seconds: float = 0.0  # running totals of the copy engine: time spent copying
    exposed_seconds: float = 0.0  # ... and the part of it the forward waited for


class TransferHandler(Protocol):
    """The worker side of the host<->GPU copies (nanovllm_offload/copy_engine.py: CopyEngine)."""
    def get_finished(self) -> TransferReport: ...
    def synchronize(self): ...
