"""The host<->GPU copies the offload manager has handed out and not yet heard back about (plain Python; no torch).
Bookkeeping only, as SGLang keeps its transfers in flight in dicts keyed by id apart from the policy: the manager
decides what to copy and advances the block states; this records who holds what until the copy engine reports it."""
import itertools
from typing import NamedTuple

from nanovllm.core.sequence import Sequence

NO_TRANSFER = -1  # the transfer id of a direction without copies this step


class StepCopies(NamedTuple):
    """A step's copies: (gpu_block_id, cpu_block_id) stores and (cpu_block_id, gpu_block_id) loads, each direction
    under one transfer id (NO_TRANSFER without copies)."""
    swap_out: list[tuple[int, int]]
    store_id: int
    swap_in: list[tuple[int, int]]
    load_id: int


class Store(NamedTuple):
    """A store in flight (GPU -> host)."""
    cpu_block_ids: list[int]  # the host blocks it fills: WRITING, each held once by it
    disk_writes: list[tuple[int, int]]  # (cpu_block_id, block_hash): to the disk tier once READY


class Load(NamedTuple):
    """A load in flight (host -> GPU): what it holds, and whom it fills."""
    cpu_holds: list[list[int]]  # per sequence it fills: the host blocks it reads, held, in release order
    seqs: list[Sequence]  # the sequences whose GPU blocks it fills: out of the batch until it lands
    gpu_block_ids: list[int]  # its destinations: loading, held by it (BlockManager.begin_loads)


class TransfersInFlight:
    """The copies of the step being scheduled (`step_*`, collected until `end_step` names them), then `stores` and
    `loads` by transfer id until the manager completes them.
    NOTE: every host block a copy reads or writes is held by that copy (one reference in the host pool) from the
          moment it is collected until the manager completes it, and so is every GPU block a load fills (in the GPU
          pool: BlockManager.begin_loads); `num_cpu_holds` and `gpu_block_ids_loading` list them for the checks."""

    def __init__(self):
        self._transfer_ids = itertools.count()
        self.step_stores: list[tuple[int, int]] = []  # (gpu_block_id, cpu_block_id)
        self.step_disk_writes: list[tuple[int, int]] = []  # (cpu_block_id, block_hash)
        self.step_loads: list[tuple[int, int]] = []  # (cpu_block_id, gpu_block_id)
        self.step_load_holds: list[list[int]] = []
        self.step_load_seqs: list[Sequence] = []
        self.step_loading: list[int] = []  # the gpu destinations of step_loads
        self.stores: dict[int, Store] = {}
        self.loads: dict[int, Load] = {}

    def add_load(self, seq: Sequence, copies: list[tuple[int, int]], held_cpu_block_ids: list[int],
                 gpu_block_ids: list[int]):
        self.step_loads += copies
        self.step_load_holds.append(held_cpu_block_ids)
        self.step_load_seqs.append(seq)
        self.step_loading += gpu_block_ids

    def end_step(self) -> StepCopies:
        """Name the collected copies: one transfer id per direction."""
        copies = StepCopies([], NO_TRANSFER, [], NO_TRANSFER)
        if self.step_stores:
            copies = copies._replace(swap_out=self.step_stores, store_id=next(self._transfer_ids))
            cpu_block_ids = [cpu_block_id for _, cpu_block_id in self.step_stores]
            self.stores[copies.store_id] = Store(cpu_block_ids, self.step_disk_writes)
            self.step_stores, self.step_disk_writes = [], []
        if self.step_loads:
            copies = copies._replace(swap_in=self.step_loads, load_id=next(self._transfer_ids))
            self.loads[copies.load_id] = Load(self.step_load_holds, self.step_load_seqs, self.step_loading)
            self.step_loads, self.step_load_holds, self.step_load_seqs, self.step_loading = [], [], [], []
        return copies

    def num_cpu_holds(self, num_cpu_blocks: int) -> list[int]:
        """For tests: the references the copies collected or in flight hold, per host block."""
        holds = [0] * num_cpu_blocks
        held = itertools.chain(
            (b for store in self.stores.values() for b in store.cpu_block_ids),
            (b for load in self.loads.values() for b in itertools.chain.from_iterable(load.cpu_holds)),
            itertools.chain.from_iterable(self.step_load_holds),
            (cpu_block_id for _, cpu_block_id in self.step_stores))
        for cpu_block_id in held:
            holds[cpu_block_id] += 1
        return holds

    def gpu_block_ids_loading(self) -> list[int]:
        """For tests: the GPU blocks the loads collected or in flight fill."""
        return [b for load in self.loads.values() for b in load.gpu_block_ids] + self.step_loading
