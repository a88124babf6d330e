"""The tiers below the GPU: KV blocks of preempted sequences (and the host prefix cache) live in a pinned host block
pool, and optionally on disk under it.

It stands on the metadata floor (nanovllm.core) and torch, never on nanovllm.engine. Two sides, as in vLLM's
kv_offload:
- the scheduler's side (plain Python): offload_manager.OffloadManager, the one object the scheduler holds: lookup
  and touch, swap or recompute, stores (swap-out, prefix-cache offload) and loads (swap-in, onload), disk
  admission, the states of the blocks in flight; host_block_pool (cpu block ids, free list, ref counts, hash
  index, block states); swap_in_allocation (GPU blocks for a swap-in); policy (swap or recompute, load or
  recompute); host_memory (sizing)
- the worker's side (torch, on every rank): copy_engine (host<->GPU copies: streams, events, the ordering rules),
  host_kv_cache (the pinned tensors), disk_transfers and disk_store (host<->disk reads and writes on threads)
- between them: transfer_report.TransferReport, the one answer to "what completed", drained once per step
"""
