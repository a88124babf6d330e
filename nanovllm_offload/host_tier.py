"""The host tier as the engine sees it: one object that the scheduler holds (or None without a tier). It decides
what happens to a victim (swap or recompute), keeps the host block bookkeeping of swap-outs, swap-ins and the host
prefix cache, and feeds the policy what the engine measured. It returns copies as (src, dst) block-id pairs; the
scheduler puts them in its SchedulerOutput and the runner's copy engine moves the bytes (plain Python; no torch)."""
from typing import TYPE_CHECKING

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm_offload.disk_tier import DiskTier, no_disk_stats
from nanovllm_offload.host_block_pool import HostBlockPool
from nanovllm_offload.host_memory import GiB, check_host_memory, num_host_blocks
from nanovllm_offload.policy import PreemptionPolicy

if TYPE_CHECKING:
    from nanovllm.config import Config

CPU_PREFILL_PRIOR = 1e3  # tokens/s: a small model's prefill on a few CPU cores


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


class HostTier:
    """The host pool (`pool`), the swap-or-recompute policy (`policy`) and the host prefix cache's switch.

    NOTE: a SWAPPED sequence's computed KV is in the host blocks of its cpu_block_table and nowhere else; the tier
          releases them once the swap-in copies are issued (the copy engine orders later copies after them, and a
          disk load into them waits for them: CopyEngine.fence).
    """

    def __init__(self, num_blocks: int, block_size: int, policy: PreemptionPolicy | None, prefix_cache: bool):
        self.pool = HostBlockPool(num_blocks)
        self.block_size = block_size
        self.policy = policy  # None: every victim is recomputed unless the caller names a mode
        self.prefix_cache = prefix_cache  # the pool is also a second-level prefix cache
        self._last_copy_totals = (0.0, 0.0)  # the copy engine's (exposed, copy) seconds at the last observation
        self.disk: DiskTier | None = None  # the tier below (attach_disk); None: no disk tier
        # the disk tier's counters when it was closed (close_disk): the writes still queued then are done by close,
        # and stats() after close() counts them (in the run that wrote them, before close, they may read 0)
        self.closed_disk_stats: dict | None = None

    @classmethod
    def from_config(cls, config: "Config", block_bytes: int, pinned: bool) -> "HostTier | None":
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

    # --- victims: swap out, swap in
    def wants_swap(self, seq: Sequence, mode: str | None) -> bool:
        """`mode` ("swap" / "recompute") overrides the policy; without either, recompute."""
        if not seq.num_computed_tokens:
            return False
        if mode is not None:
            return mode == "swap"
        return self.policy is not None and self.policy.should_swap(seq)

    def swap_out(self, seq: Sequence, gpu_blocks: BlockManager,
                 hand_out_last: list[int]) -> list[tuple[int, int]] | None:
        """Host blocks for seq's computed GPU blocks: the (gpu_block_id, cpu_block_id) copies to make, or None when
        the pool is short (all or nothing). The copies come in the order the GPU blocks will be handed out again, so
        the next owner's forward waits for one block's copy rather than for the victim's whole KV; the blocks in
        `hand_out_last` (written by the step in flight) are copied, and handed out, last."""
        copies = self.pool.swap_out(seq, gpu_blocks.computed_block_ids(seq))
        if copies is None:
            return None
        rank = gpu_blocks.reuse_rank(seq.block_table, hand_out_last)
        copies.sort(key=lambda c: rank[c[0]])
        return copies

    def swap_in(self, seq: Sequence, gpu_blocks: BlockManager, num_reserved_blocks: int,
                max_num_batched_tokens: int) -> list[tuple[int, int]] | None:
        """GPU blocks for a SWAPPED seq, with room for its next step (at most max_num_batched_tokens): the
        (cpu_block_id, gpu_block_id) copies to make (blocks still cached on the GPU need none), or None when the GPU
        is short. Its host blocks are released: once the copies are issued, nothing reads them (cached ones stay
        findable)."""
        num_next_tokens = min(seq.num_uncomputed_tokens, max_num_batched_tokens)
        copies = gpu_blocks.allocate_for_swap_in(seq, num_reserved_blocks, num_next_tokens)
        if copies is not None:
            self.pool.free(seq)
        return copies

    def free(self, seq: Sequence) -> bool:
        """Release seq's host blocks (it finished or was aborted). True when it was waiting for a disk load (so it
        was in no scheduler queue)."""
        self.pool.free(seq)
        return self.disk is not None and self.disk.drop(seq)

    # --- the host prefix cache: lookup, onload, offload
    def num_prefix_candidates(self, seq: Sequence, num_gpu_hits: int) -> int:
        """Full blocks past seq's GPU hits that the host could hold (never the block of the last prompt token)."""
        if not self.prefix_cache:
            return 0
        return max(0, (seq.num_tokens - 1) // self.block_size - num_gpu_hits)

    def find_prefix(self, seq: Sequence, num_gpu_hits: int) -> list[int]:
        """Host blocks that continue seq's GPU prefix hit."""
        num_candidates = self.num_prefix_candidates(seq, num_gpu_hits)
        if not num_candidates:
            return []
        return self.pool.find_cached_prefix(seq, num_gpu_hits, num_candidates)

    def onload(self, seq: Sequence, cpu_block_ids: list[int]) -> list[tuple[int, int]]:
        """(cpu_block_id, gpu_block_id) copies of host hits into the GPU blocks just allocated for them; the hits count
        as computed from now on (the runner makes the next forward that reads them wait for the copies)."""
        first = seq.num_computed_tokens // self.block_size
        gpu_block_ids = seq.block_table[first:first + len(cpu_block_ids)]
        seq.num_computed_tokens += len(cpu_block_ids) * self.block_size
        return list(zip(cpu_block_ids, gpu_block_ids))

    def offload(self, candidates: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(gpu_block_id, cpu_block_id) copies of cached GPU blocks (gpu_block_id, block_hash) that the host prefix
        cache does not hold yet; blocks the pool has no room for are skipped."""
        if not self.prefix_cache:
            return []
        copies = []
        for gpu_block_id, block_hash in candidates:
            cpu_block_id = self.pool.store(block_hash)
            if cpu_block_id is not None:
                copies.append((gpu_block_id, cpu_block_id))
                if self.disk is not None:
                    self.disk.hold_for_write(cpu_block_id, block_hash)
        return copies

    def can_reset_cache(self) -> bool:
        """False while any host block is held: by a swapped sequence, or by a disk write or load."""
        return self.pool.can_reset_cache()

    def reset_cache(self) -> bool:
        return self.pool.reset_cache()

    # --- the disk tier below the host pool (nanovllm_offload/disk_tier.py)
    def attach_disk(self, store, host_blocks, on_cpu: bool = False):
        """Put a disk store (disk_tier.open_disk_store) under the pool; host_blocks: the pool's bytes as a
        (num_blocks, block_bytes) uint8 numpy view."""
        self.policy = self.policy or PreemptionPolicy("auto", store.block_bytes)
        if on_cpu:  # the prefill prior decides a disk hit at start-up (nothing measured yet), and the GPU-sized prior
            self.policy.prefill_tokens_per_s = CPU_PREFILL_PRIOR  # would skip a disk that beats a CPU's prefill
        self.disk = DiskTier(store, host_blocks, self.pool, self.policy, self.block_size)

    def start_disk_load(self, seq: Sequence, num_hit_blocks: int, host_hit_ids: list[int]) -> bool:
        """True when seq's next blocks are being loaded from disk: it waits out of the queues (poll_disk).
        num_hit_blocks: its GPU and host hits; host_hit_ids: the host ones, which the load leaves in place."""
        return self.prefix_cache and self.disk is not None and self.disk.start_load(seq, num_hit_blocks,
                                                                                    host_hit_ids)

    def submit_disk_transfers(self, copy_engine):
        """Call after a step's copies are issued. Hands the blocks held for disk writes to the store once every
        swap-out has landed (the copies into them are done), and starts the disk reads whose host blocks no
        host<->GPU copy touches any more (CopyEngine.fence: the copies issued so far)."""
        if self.disk is None:
            return
        if self.disk.pending_writes and copy_engine.out_copies_done():
            self.disk.submit_writes()
        if self.disk.pending_loads:
            self.disk.submit_loads(copy_engine.fence())

    def settle_disk(self, copy_engine):
        """With nothing running: finish the copies, start the held writes and loads, and wait for every disk transfer
        (the next poll_disk releases their host blocks)."""
        if self.disk is None:
            return
        copy_engine.synchronize()
        self.submit_disk_transfers(copy_engine)
        self.disk.store.wait_idle()

    def close_disk(self):
        """Finish the disk tier's writes and loads and close it; its counters stay in stats(), those writes counted."""
        disk, self.disk = self.disk, None
        disk.close()
        self.closed_disk_stats = disk.stats()

    def poll_disk(self) -> list[Sequence]:
        """Sequences whose disk loads came back (their blocks are host hits now); never blocks."""
        return self.disk.poll() if self.disk is not None else []

    @property
    def num_disk_waiting(self) -> int:
        return self.disk.num_waiting_seqs if self.disk is not None else 0

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

    def observe_copies(self, copies: list[tuple[int, float]], copy_seconds: float, exposed_seconds: float):
        """copies: (bytes, seconds) timed since the last call; the totals: the copy engine's running sums."""
        if self.policy is None:
            return
        for num_bytes, seconds in copies:
            self.policy.observe_copy(num_bytes, seconds)
        if copies:
            last_exposed, last_copy = self._last_copy_totals
            self.policy.observe_exposure(exposed_seconds - last_exposed, copy_seconds - last_copy)
            self._last_copy_totals = (exposed_seconds, copy_seconds)
