"""The host tier: KV blocks of preempted sequences (and the host prefix cache) live in a pinned host block pool.

It stands on the metadata floor (nanovllm.core) and torch, never on nanovllm.engine; the engine talks to it through
one object:
- host_tier: HostTier, the face the scheduler holds: sizing, swap or recompute, swap/onload/offload bookkeeping,
  what the policy observes (plain Python)
- host_block_pool: cpu block ids, free list, ref counts, hash index (plain Python)
- host_memory: how many host blocks swap_space buys, and whether the host can hold them (plain Python)
- policy: swap or recompute, per victim (plain Python)
- host_kv_cache: the host tensors (torch)
- copy_engine: streams, events and transfers in flight (torch; owned by the model runner)
"""
