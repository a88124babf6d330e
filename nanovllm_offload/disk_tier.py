"""The disk tier in host-pool terms: which host blocks go to disk, which disk hits come back into host blocks, and
what that cost (plain Python and numpy; no torch). The offload manager owns one; the store does the I/O on its
threads.

Life of a block (docs/disk_tier.md):
1. A full, hashed block that the host prefix cache stores is written to disk once its copy from the GPU has landed
   (the manager's completion of the store calls `write`); the write keeps the store's reference on the host block,
   so the pool cannot hand it out (and a copy cannot overwrite it) before the write has read it.
2. On admission, past the GPU and host hits, the disk is asked for the next blocks; a hit is loaded only where
   reading it beats prefilling it (`PreemptionPolicy.should_load_from_disk`). The sequence then waits out of every
   queue while the store's threads read the blocks into free host blocks, WRITING until `poll` reports them. The
   reads start at once: a block in the free queue is touched by no copy (a copy's blocks are held by their
   transfer until it lands: OffloadManager).
3. Once read, the blocks are READY and hashed into the host prefix cache, and the sequence goes back to the front
   of the waiting queue, where the next admission finds them as host hits and copies them to the GPU like any other.
"""
import json
import logging
import os
from typing import TYPE_CHECKING

from nanovllm.config import rope_parameters
from nanovllm.core.hashing import content_hash
from nanovllm.core.sequence import Sequence
from nanovllm_offload.disk_fingerprint import WEIGHT_HASHES_FILE, kv_fingerprint
from nanovllm_offload.disk_store import GiB, DiskRead, DiskStore
from nanovllm_offload.disk_transfers import DiskTransfers
from nanovllm_offload.host_block_pool import HostBlockPool
from nanovllm_offload.policy import PreemptionPolicy

if TYPE_CHECKING:
    import numpy as np

    from nanovllm.config import Config

# how an FP8 block keeps its scales (nanovllm/layers/kv_layout.py): per (layer, K or V), the FP8 values, then one
# bfloat16 scale per token and kv head; K Hadamard-rotated. Any change to that arrangement must change this string.
FP8_SCALE_LAYOUT = "fp8-token-head-scales-v1: per (layer, K|V) values then bf16 scale per (token, kv head); K rotated"
DISK_STAT_KEYS = ("disk_hit_tokens", "disk_loaded_tokens", "disk_skipped_tokens", "blocks_written_to_disk",
                  "disk_read_bytes", "disk_write_bytes", "disk_corrupt_blocks", "disk_write_errors",
                  "blocks_evicted_from_disk")
logger = logging.getLogger(__name__)
NO_OWNER = -1  # the owner id a write's or a load's hold on a host block is released under


def open_disk_store(config: "Config", runner, tp_rank: int = 0) -> DiskStore:
    """The store of `config.kv_disk_path` for this rank's blocks, fingerprinted by everything that makes their
    bytes what they are (the runner's dtype, num_layers, num_kv_heads per rank, head_dim, block_bytes and the
    config's), with its read speed probed on what an earlier run left (so the load rule starts from a measurement,
    not the prior)."""
    kv_cache_dtype = {"fp8": "fp8_e4m3"}.get(config.kv_cache_dtype, config.kv_cache_dtype)
    os.makedirs(config.kv_disk_path, exist_ok=True)  # the weights' digests are kept in it
    fingerprint = kv_fingerprint(
        config.model, dtype=str(runner.dtype).removeprefix("torch."), kv_cache_dtype=kv_cache_dtype,
        block_size=config.kvcache_block_size, num_layers=runner.num_layers, num_kv_heads=runner.num_kv_heads,
        head_dim=runner.head_dim, tp_size=config.tensor_parallel_size, tp_rank=tp_rank, block_bytes=runner.block_bytes,
        kv_scale_layout=FP8_SCALE_LAYOUT if config.is_fp8_kv else None,
        load_format=config.load_format, seed=config.seed, model_options=model_options(config),
        hash_cache_path=os.path.join(config.kv_disk_path, WEIGHT_HASHES_FILE))
    store = DiskStore(config.kv_disk_path, fingerprint, int(config.kv_disk_gib * GiB))
    probe = store.probe_read_speed()
    if probe is not None:
        is_done = store.wait_idle(timeout_s=5.0)
        store.poll()  # the probe's handle: nothing to hand back
        log_probe(store, probe if is_done else None)
    return store


def model_options(config: "Config") -> dict:
    """What decides the KV besides the files and the dtypes, as plain JSON data: the rope (its scaling included)
    and the weights' quantization (config.json's quantization_config, and the engine's quantization option)."""
    hf = config.hf_config
    quantization_config = getattr(hf, "quantization_config", None)
    if hasattr(quantization_config, "to_dict"):
        quantization_config = quantization_config.to_dict()
    options = {"rope": rope_parameters(hf), "quantization_config": quantization_config,
               "quantization": getattr(config, "quantization", None)}
    return json.loads(json.dumps(options, sort_keys=True, default=repr))


def log_probe(store: DiskStore, probe: DiskRead | None):
    """The start-up probe's outcome: its speed, or why the prior decides until the first read."""
    num_ok = 0 if probe is None else probe.num_ok
    if not num_ok:
        reason = "the probe read nothing" if probe is not None else "the probe did not finish in 5 s"
        logger.info("disk tier: %s; the prior %.2f GB/s decides until a read is measured", reason,
                    store.read_bytes_per_s / 1e9)
        return
    logger.info("disk tier: read speed measured at start-up: %.2f GB/s (%d blocks, %.1f MB in %.1f ms); a hit is "
                "loaded where reading it beats prefilling it", store.read_bytes_per_s / 1e9, num_ok,
                num_ok * store.file_bytes / 1e6, (probe.last_end_s - probe.first_start_s) * 1e3)


class DiskTier:
    """Writes and loads in flight (`transfers`, `loading`) and the counters.

    NOTE: a host block being written to disk or loaded from it holds one reference (owner NO_OWNER), so it is out
          of the pool's free queue: never handed out, never overwritten, until poll() releases it. A block a load
          fills is WRITING until then, so no lookup finds it.
    NOTE: a sequence in `loading` is in no scheduler queue; its status stays WAITING. A finished one's entry stays
          (with seq None) until its load comes back, so the load's host blocks are released then.
    """

    def __init__(self, store: DiskStore, host_blocks: "np.ndarray", pool: HostBlockPool, policy: PreemptionPolicy,
                 block_size: int):
        self.store = store
        self.transfers = DiskTransfers(store, host_blocks)
        self.pool, self.policy, self.block_size = pool, policy, block_size
        self.loading: dict[int, tuple[Sequence, list[int]]] = {}  # seq_id -> (seq, the block hashes it loads)
        self.decided_seq_ids: set[int] = set()  # asked the disk once; not again until they finish
        self.counters = dict.fromkeys(("disk_hit_tokens", "disk_loaded_tokens", "disk_skipped_tokens"), 0)

    # --- writes
    def write(self, cpu_block_id: int, block_hash: int) -> bool:
        """Write a READY host block that the host prefix cache stored, holding the caller's reference on it until
        poll() reports the write. False (the reference stays the caller's) when there is nothing to write: the
        block is stored already (by an earlier run, or another engine)."""
        return self.transfers.write(cpu_block_id, block_hash)

    # --- loads
    def start_load(self, seq: Sequence, num_hit_blocks: int, host_hit_ids: list[int]) -> bool:
        """Ask the disk for seq's full blocks after its first num_hit_blocks (GPU and host hits, `host_hit_ids`
        among them; never the block of the last prompt token) and load them if the rule says so. True: a load
        started and seq must wait for it out of the queues."""
        num_candidates = (seq.num_tokens - 1) // self.block_size - num_hit_blocks
        if num_candidates <= 0 or seq.seq_id in self.decided_seq_ids:
            return False
        self.decided_seq_ids.add(seq.seq_id)
        block_hashes = [content_hash(seq, i) for i in range(num_hit_blocks, num_hit_blocks + num_candidates)]
        num_found = self.store.lookup_prefix(block_hashes)
        if not num_found:
            return False
        num_tokens = num_found * self.block_size
        self.counters["disk_hit_tokens"] += num_tokens
        # blocks of swapped sequences are not free, and seq's own host hits must not be evicted for its load
        num_blocks = max(0, min(num_found, self.pool.num_free_blocks - self.pool.num_revived(host_hit_ids)))
        if not num_blocks:
            self.counters["disk_skipped_tokens"] += num_tokens
            return False
        if not self.policy.should_load_from_disk(num_tokens, num_found * self.store.block_bytes,
                                                 self.store.read_bytes_per_s):
            self.counters["disk_skipped_tokens"] += num_tokens
            self.store.reprobe_if_stale()  # a skipped hit measures nothing; the disk may have become faster
            return False
        self.counters["disk_skipped_tokens"] += (num_found - num_blocks) * self.block_size
        cpu_block_ids = [self.pool.pop_free() for _ in range(num_blocks)]  # the hits are used last: never reached
        self.pool.begin_writes(cpu_block_ids)
        self.transfers.load(seq.seq_id, block_hashes[:num_blocks], cpu_block_ids)
        self.loading[seq.seq_id] = (seq, block_hashes[:num_blocks])
        return True

    def poll(self) -> list[Sequence]:
        """Release the host blocks of finished writes; make the blocks of finished loads READY and hash them into the
        host prefix cache (the leading run read whole; the rest go back to the pool) and return their sequences,
        still waiting. Never blocks."""
        written, loads = self.transfers.get_finished()
        for cpu_block_id in written:
            self.pool.release(cpu_block_id, NO_OWNER)
        ready = []
        for load in loads:
            seq, block_hashes = self.loading.pop(load.seq_id)
            self.pool.finish_writes(load.cpu_block_ids)
            for i, cpu_block_id in enumerate(load.cpu_block_ids):
                if i < load.num_loaded and block_hashes[i] not in self.pool.hash_to_block_id:
                    self.pool.set_hash(cpu_block_id, block_hashes[i])
                self.pool.release(cpu_block_id, NO_OWNER)  # hashed: cached at the tail; the rest: FREE, at the head
            self.counters["disk_loaded_tokens"] += load.num_loaded * self.block_size
            if seq is not None:
                ready.append(seq)
        return ready

    def drop(self, seq: Sequence) -> bool:
        """Forget seq (finished or aborted). True when it was waiting for a load: its blocks come back with poll."""
        self.decided_seq_ids.discard(seq.seq_id)
        if self.loading.get(seq.seq_id, (None,))[0] is not seq:
            return False
        self.loading[seq.seq_id] = (None, self.loading[seq.seq_id][1])  # the load still fills its blocks
        return True

    def held_cpu_block_ids(self) -> dict[int, int]:
        """For invariant checks: cpu_block_id -> references the disk's transfers hold on it."""
        held = dict(self.transfers.writing)
        for cpu_block_id in self.transfers.loading:
            held[cpu_block_id] = held.get(cpu_block_id, 0) + 1
        return held

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences out of the queues, waiting for their loads."""
        return sum(seq is not None for seq, _ in self.loading.values())

    # --- lifetime and counters
    def flush(self):
        """Wait for every write and load and release their blocks (engine close)."""
        self.store.wait_idle()
        self.poll()

    def close(self):
        self.flush()
        self.store.close()

    def stats(self) -> dict:
        store = self.store.stats()
        return dict(self.counters, **{k: store[k] for k in DISK_STAT_KEYS if k in store},
                    disk_read_bytes_per_s=store["disk_read_bytes_per_s"])


def no_disk_stats() -> dict:
    return dict.fromkeys(DISK_STAT_KEYS, 0)
