"""The tiers as the scheduler sees them: one manager in the shape of vLLM's OffloadingManager (lookup and touch,
prepare and complete a store, prepare and complete a load). It decides what happens to a victim (swap or recompute),
does the host bookkeeping of swap-out, swap-in and the host prefix cache, admits disk hits, and owns the state of
every block in flight. The scheduler holds it (or None without a tier) and calls only its methods (plain Python; no
torch).

Copies leave it as (src, dst) block-id pairs in the step's SchedulerOutput, one transfer id per direction
(`end_step`); the copy engine moves the bytes and names the ids that landed in a TransferReport, which the engine
hands to `complete` once per step. Completions, and only completions, advance the states:
- a host block is FREE -> RESERVED (handed out) -> WRITING (its step's copies went out) -> READY (they landed);
  only READY blocks are found by `lookup`, and a block in flight is held by its transfer, so it is never evicted;
- a host block a load reads is held until the load lands, then released (a cached one stays findable);
- a GPU block a load fills is loading (BlockManager.loading) and held by the load until it lands; a sequence of a
  load in flight waits out of the batch (`seq_ids_to_hold`) meanwhile.
"""
import logging
from typing import TYPE_CHECKING

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm_offload.disk_tier import DiskTier, no_disk_stats
from nanovllm_offload.host_block_pool import HostBlockPool
from nanovllm_offload.host_memory import GiB, check_host_memory, num_host_blocks_for
from nanovllm_offload.policy import PreemptionPolicy
from nanovllm_offload.swap_in_allocation import allocate_for_swap_in
from nanovllm_offload.transfer_report import TransferHandler, TransferReport
from nanovllm_offload.transfers_in_flight import StepCopies, TransfersInFlight

if TYPE_CHECKING:
    from nanovllm.config import Config

logger = logging.getLogger(__name__)
CPU_PREFILL_PRIOR = 1e3  # tokens/s: a small model's prefill on a few CPU cores
TRANSFER_HOLD = -1  # the owner a transfer's reference on a host block is released under (in error messages)


class OffloadManager:
    """The host pool (`pool`), the swap-or-recompute policy (`policy`), the disk tier below (`disk`) and the
    transfers in flight. vLLM's OffloadingManager, method for method: lookup -> `lookup`, touch -> `touch`,
    prepare_store -> `swap_out` (a victim's blocks) and `store_cached_blocks` (the prefix cache's), prepare_load ->
    `swap_in` and `load_prefix_hits`, complete_store and complete_load -> `complete` (by the ids the copy engine
    reports); `end_step` names the step's transfers.

    NOTE: a SWAPPED sequence's computed KV is in the host blocks of its cpu_block_table and nowhere else. Its
          swap-in moves those references to the load, which releases them when it lands.
    NOTE: the copies handed out and not yet completed, and who they hold, are in `transfers` (TransfersInFlight).
    NOTE: one GPU pool: `gpu_pool` is the BlockManager that swap_in and load_prefix_hits were given, whose loading
          blocks `complete` finishes.
    """

    def __init__(self, num_blocks: int, block_size: int, policy: PreemptionPolicy | None, prefix_cache: bool):
        self.pool = HostBlockPool(num_blocks)
        self.block_size = block_size
        self.policy = policy  # None: every victim is recomputed unless the caller names a mode
        self.prefix_cache = prefix_cache  # the pool is also a second-level prefix cache
        self.disk: DiskTier | None = None  # the tier below (attach_disk); None: no disk tier
        # the disk tier's counters when it was closed (close_disk): the writes still queued then are done by close,
        # and stats() after close() counts them (in the run that wrote them, before close, they may read 0)
        self.closed_disk_stats: dict | None = None
        self.transfers = TransfersInFlight()
        self.gpu_pool: BlockManager | None = None
        self._loaded_from_disk: list[Sequence] = []  # disk loads that landed, for the scheduler's next step
        # the gpu blocks the step scheduled last writes (SchedulerOutput.written_gpu_block_ids); as a set once a
        # swap-out asks (None until then)
        self._written_in_flight: list[int] = []
        self._written_in_flight_set: set[int] | None = None
        self._said_swap_fallback = False

    @classmethod
    def from_config(cls, config: "Config", block_bytes: int, pinned: bool) -> "OffloadManager | None":
        """The tier `config` asks for, after checking that every rank's pool fits in host memory (ValueError
        naming swap_space when not); None without one. The caller allocates the host tensors of `num_blocks`."""
        num_blocks = num_host_blocks_for(config, block_bytes)
        if num_blocks is None:
            return None
        if not num_blocks and config.kv_disk_path is not None:  # without it, swaps recompute (said once)
            raise ValueError(f"kv_disk_path needs host blocks to load into, but swap_space={config.swap_space:g} GiB "
                             f"buys none of {block_bytes / GiB:.4g} GiB; raise swap_space")
        check_host_memory(num_blocks * block_bytes, config.tensor_parallel_size, config.swap_space, pinned)
        return cls(num_blocks, config.kvcache_block_size, PreemptionPolicy(config.preemption_mode, block_bytes),
                   config.host_prefix_cache)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # --- victims: swap out (a store), swap in (a load)
    def wants_swap(self, seq: Sequence, mode: str | None) -> bool:
        """`mode` ("swap" / "recompute") overrides the policy; without either, recompute."""
        if not seq.num_computed_tokens:
            return False
        if mode is not None:
            return mode == "swap"
        return self.policy is not None and self.policy.should_swap(seq)

    def swap_out(self, seq: Sequence, gpu_blocks: BlockManager) -> int | None:
        """Store seq's computed KV in host blocks and free its GPU blocks: the number of blocks to copy, or None
        (nothing changed) when the pool is short. The copies go in the order the GPU blocks are handed out again,
        so the next owner's forward waits for one block's copy rather than for the victim's whole KV; the blocks
        the step in flight writes are copied, and handed out, last (the copy engine copies those after its forward:
        both read SchedulerOutput.written_gpu_block_ids)."""
        copies = self.pool.swap_out(seq, gpu_blocks.computed_block_ids(seq))
        if copies is None:
            self._say_swap_fallback(seq, gpu_blocks)
            return None
        hand_out_order = gpu_blocks.free_swapped_out(seq, self._blocks_in_flight(seq))
        rank = {gpu_block_id: i for i, gpu_block_id in enumerate(hand_out_order)}
        copies.sort(key=lambda c: rank[c[0]])
        for _, cpu_block_id in copies:
            self.pool.take(cpu_block_id)  # the store's hold: an abort of seq must not free a block being written
        self.transfers.step_stores += copies
        return len(copies)

    def _blocks_in_flight(self, seq: Sequence) -> list[int]:
        """seq's blocks that the step scheduled last writes: with asynchronous scheduling its forward may still be
        running."""
        if self._written_in_flight_set is None:
            self._written_in_flight_set = set(self._written_in_flight)
        written = self._written_in_flight_set
        return [gpu_block_id for gpu_block_id in seq.block_table if gpu_block_id in written]

    def _say_swap_fallback(self, seq: Sequence, gpu_blocks: BlockManager):
        """A swap becomes a recompute (no room in the host pool): said once, since it costs prefill time that the
        user chose swapping to save (the scheduler counts each one)."""
        if self._said_swap_fallback:
            return
        self._said_swap_fallback = True
        num_blocks = len(gpu_blocks.computed_block_ids(seq))
        pool = self.pool
        why = (f"the host pool holds {pool.num_blocks} blocks, fewer than its {num_blocks}"
               if num_blocks > pool.num_blocks
               else f"the host pool has {pool.num_free_blocks} of {pool.num_blocks} blocks free")
        logger.warning("seq %d was to be swapped out but is recomputed: %s; raise swap_space (counted in stats()"
                       "['swap_fallback_recomputes'], said once)", seq.seq_id, why)

    def swap_in(self, seq: Sequence, gpu_blocks: BlockManager, num_reserved_blocks: int,
                max_num_batched_tokens: int) -> int | None:
        """GPU blocks for a SWAPPED seq, with room for its next step (at most max_num_batched_tokens): the number of
        blocks to copy back (blocks still cached on the GPU need none), or None (nothing changed) when the GPU is
        short. Its host blocks are held by the load until it lands."""
        num_next_tokens = min(seq.num_uncomputed_tokens, max_num_batched_tokens)
        copies = allocate_for_swap_in(seq, gpu_blocks, num_reserved_blocks, num_next_tokens)
        if copies is None:
            return None
        held, seq.cpu_block_table = seq.cpu_block_table[::-1], []  # released last block first, as pool.free does
        self._prepare_load(seq, copies, held, gpu_blocks)
        return len(copies)

    def free(self, seq: Sequence) -> bool:
        """Release seq's host blocks (it finished or was aborted). True when it was waiting for a disk load (so it
        was in no scheduler queue)."""
        self.pool.free(seq)
        return self.disk is not None and self.disk.drop(seq)

    # --- the host prefix cache: lookup, touch, onload (a load), offload (a store)
    def num_prefix_candidates(self, seq: Sequence, num_gpu_hits: int) -> int:
        """Full blocks past seq's GPU hits that the host could hold (never the block of the last prompt token)."""
        if not self.prefix_cache:
            return 0
        return max(0, (seq.num_tokens - 1) // self.block_size - num_gpu_hits)

    def lookup(self, seq: Sequence, num_gpu_hits: int) -> list[int]:
        """READY host blocks that continue seq's GPU prefix hit."""
        num_candidates = self.num_prefix_candidates(seq, num_gpu_hits)
        if not num_candidates:
            return []
        return self.pool.find_cached_prefix(seq, num_gpu_hits, num_candidates)

    def touch(self, cpu_block_ids: list[int]):
        """Hits become the most recently used host blocks."""
        self.pool.touch(cpu_block_ids)

    def load_prefix_hits(self, seq: Sequence, cpu_block_ids: list[int], gpu_blocks: BlockManager):
        """Copy host hits into the GPU blocks just allocated for them; the hits count as computed from now on, and
        seq waits out of the batch until they land. The hits are held until then: not evictable meanwhile; the GPU
        blocks are loading."""
        first = seq.num_computed_tokens // self.block_size
        gpu_block_ids = seq.block_table[first:first + len(cpu_block_ids)]
        seq.num_computed_tokens += len(cpu_block_ids) * self.block_size
        for cpu_block_id in cpu_block_ids:
            self.pool.take(cpu_block_id)
        self._prepare_load(seq, list(zip(cpu_block_ids, gpu_block_ids)), cpu_block_ids, gpu_blocks)

    def _prepare_load(self, seq: Sequence, copies: list[tuple[int, int]], held_cpu_block_ids: list[int],
                      gpu_blocks: BlockManager):
        if not copies:  # every block still cached on the GPU: nothing to wait for
            for cpu_block_id in held_cpu_block_ids:
                self.pool.release(cpu_block_id, seq.seq_id)
            return
        self.gpu_pool = gpu_blocks
        gpu_block_ids = [gpu_block_id for _, gpu_block_id in copies]
        gpu_blocks.begin_loads(gpu_block_ids)
        self.transfers.add_load(seq, copies, held_cpu_block_ids, gpu_block_ids)

    def store_cached_blocks(self, candidates: list[tuple[int, int]]) -> int:
        """Copy cached GPU blocks (gpu_block_id, block_hash) that the host prefix cache does not hold yet; blocks the
        pool has no room for are skipped. Returns how many are copied."""
        if not self.prefix_cache:
            return 0
        num_stored = 0
        for gpu_block_id, block_hash in candidates:
            cpu_block_id = self.pool.store(block_hash)  # RESERVED, held by the store
            if cpu_block_id is not None:
                self.transfers.step_stores.append((gpu_block_id, cpu_block_id))
                num_stored += 1
                if self.disk is not None:
                    self.transfers.step_disk_writes.append((cpu_block_id, block_hash))
        return num_stored

    def can_reset_cache(self) -> bool:
        """False while any host block is held: by a swapped sequence, a transfer in flight, or the disk."""
        return self.pool.can_reset_cache()

    def reset_cache(self) -> bool:
        return self.pool.reset_cache()

    # --- once per step: hand the copies out, take the completions in
    def end_step(self, written_gpu_block_ids: list[int]) -> StepCopies:
        """The copies of the step just scheduled, whose forward writes written_gpu_block_ids, and of preempt() calls
        since the last one. Their host destinations are WRITING from now on."""
        self._written_in_flight, self._written_in_flight_set = written_gpu_block_ids, None
        copies = self.transfers.end_step()
        if copies.swap_out:
            self.pool.begin_writes(self.transfers.stores[copies.store_id].cpu_block_ids)
        return copies

    def seq_ids_to_hold(self, running: list[Sequence]) -> set[int]:
        """Ids of the running sequences to leave out of this step because blocks of theirs are loading: those of the
        loads in flight (a sequence resumed twice is in two, and loads land in order, so the later one decides);
        none when nothing else could run (then the forward waits for the copies on the device instead: the copy
        engine's rule 3)."""
        if not self.transfers.loads:
            return set()
        held = {seq.seq_id for load in self.transfers.loads.values() for seq in load.seqs
                if seq.status == SequenceStatus.RUNNING}
        return set() if len(held) == len(running) else held

    def complete(self, report: TransferReport):
        """Advance every transfer `report` names, then the disk's: a store's host blocks become READY (and those
        for the disk go to it), a load's host blocks are released and its sequences may join the batch, a disk
        load's sequence goes back to the scheduler (take_loaded_from_disk). The copies' timings feed the policy."""
        stores, loads = self.transfers.stores, self.transfers.loads
        for transfer_id in report.finished_ids:
            if transfer_id in stores:
                self._complete_store(transfer_id)
            elif transfer_id in loads:
                self._complete_load(transfer_id)
            else:
                raise RuntimeError(f"OffloadManager.complete: transfer {transfer_id} is not in flight "
                                   f"(stores {sorted(stores)}, loads {sorted(loads)})")
        if self.policy is not None:
            self.policy.observe_copies(report)
        if self.disk is not None:
            self._loaded_from_disk += self.disk.poll()

    def _complete_store(self, store_id: int):
        cpu_block_ids, disk_writes = self.transfers.stores.pop(store_id)
        self.pool.finish_writes(cpu_block_ids)
        to_disk = {cpu_block_id for cpu_block_id, block_hash in disk_writes
                   if self.disk.write(cpu_block_id, block_hash)}  # the store's hold becomes the write's
        for cpu_block_id in cpu_block_ids:
            if cpu_block_id not in to_disk:
                self.pool.release(cpu_block_id, TRANSFER_HOLD)

    def _complete_load(self, load_id: int):
        load = self.transfers.loads.pop(load_id)
        for held in load.cpu_holds:
            for cpu_block_id in held:
                self.pool.release(cpu_block_id, TRANSFER_HOLD)
        self.gpu_pool.finish_loads(load.gpu_block_ids)

    def settle(self, copies: TransferHandler):
        """With nothing running: wait for every copy and disk transfer and complete them (a prefix-cache reset, or
        close, follows). A transfer the copy engine still does not report then was never issued (its step raised
        before its launch): its holds are dropped, and the blocks it was to fill hold nothing (FREE)."""
        copies.synchronize()
        self.complete(copies.get_finished())
        for store_id in list(self.transfers.stores):
            cpu_block_ids, _ = self.transfers.stores.pop(store_id)
            self.pool.abandon_writes(cpu_block_ids)
            for cpu_block_id in cpu_block_ids:
                self.pool.release(cpu_block_id, TRANSFER_HOLD)
        for load_id in list(self.transfers.loads):
            self._complete_load(load_id)  # the host blocks it was to read are intact
        if self.disk is not None:
            self.disk.store.wait_idle()
            self._loaded_from_disk += self.disk.poll()

    def check_invariants(self, seqs: list[Sequence] = ()):
        """For tests: the host pool's, with the references that transfers in flight and the disk hold."""
        holds = self.transfers.num_cpu_holds(self.pool.num_blocks)
        if self.disk is not None:
            for cpu_block_id, n in self.disk.held_cpu_block_ids().items():
                holds[cpu_block_id] += n
        self.pool.check_invariants(seqs, holds)
        loading = self.transfers.gpu_block_ids_loading()
        gpu_loading = self.gpu_pool.loading if self.gpu_pool is not None else set()
        if sorted(loading) != sorted(gpu_loading):
            raise RuntimeError(f"the loads in flight fill gpu blocks {sorted(loading)}, but gpu blocks "
                               f"{sorted(gpu_loading)} are loading")

    # --- the disk tier below the host pool (nanovllm_offload/disk_tier.py)
    def attach_disk(self, store, host_blocks, on_cpu: bool = False):
        """Put a disk store (disk_tier.open_disk_store) under the pool; host_blocks: the pool's bytes as a
        (num_blocks, block_bytes) uint8 numpy view."""
        self.policy = self.policy or PreemptionPolicy("auto", store.block_bytes)
        if on_cpu:  # the prefill prior decides a disk hit at start-up (nothing measured yet), and the GPU-sized prior
            self.policy.prefill_tokens_per_s = CPU_PREFILL_PRIOR  # would skip a disk that beats a CPU's prefill
        self.disk = DiskTier(store, host_blocks, self.pool, self.policy, self.block_size)

    def start_disk_load(self, seq: Sequence, num_hit_blocks: int, host_hit_ids: list[int]) -> bool:
        """Disk admission. True when seq's next blocks are being loaded from disk: it waits out of the queues until
        take_loaded_from_disk returns it. num_hit_blocks: its GPU and host hits; host_hit_ids: the host ones, which
        the load leaves in place."""
        return self.prefix_cache and self.disk is not None and self.disk.start_load(seq, num_hit_blocks,
                                                                                    host_hit_ids)

    def take_loaded_from_disk(self) -> list[Sequence]:
        """Sequences whose disk loads landed (their blocks are host hits now), oldest first; never blocks."""
        loaded, self._loaded_from_disk = self._loaded_from_disk, []
        return loaded

    def close_disk(self):
        """Finish the disk tier's writes and loads and close it; its counters stay in stats(), those writes counted."""
        disk, self.disk = self.disk, None
        disk.close()
        self.closed_disk_stats = disk.stats()

    @property
    def num_disk_waiting(self) -> int:
        """Sequences out of the queues for a disk load: in flight, or landed and not taken yet."""
        return (self.disk.num_waiting_seqs if self.disk is not None else 0) + len(self._loaded_from_disk)

    def stats(self) -> dict:
        """The pool's size, the disk tier's counters (zeros without one) and the policy's prefill speed now."""
        disk_stats = self.disk.stats() if self.disk is not None else self.closed_disk_stats or no_disk_stats()
        stats = dict(num_cpu_blocks=self.num_blocks, **disk_stats)
        if self.policy is not None:
            stats["prefill_tokens_per_s"] = self.policy.prefill_tokens_per_s
        return stats

    @staticmethod
    def no_tier_stats() -> dict:
        """stats() of an engine without a host tier."""
        return dict(num_cpu_blocks=0, **no_disk_stats())

    # --- what the engine measured, for the policy
    def seed_prefill_speed(self, tokens_per_s: float | None):
        """Start the policy from the prefill speed the runner measured at start-up (None: nothing measured, as on
        the CPU, and the prior stays): the first admission's disk hits are decided before any step is timed."""
        if self.policy is not None and tokens_per_s is not None and tokens_per_s > 0:
            self.policy.prefill_tokens_per_s = tokens_per_s

    def observe_prefill(self, num_tokens: int, seconds: float):
        if self.policy is not None:
            self.policy.observe_prefill(num_tokens, seconds)

