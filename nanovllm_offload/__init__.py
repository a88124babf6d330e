"""The host tier: KV blocks of preempted sequences live in a (pinned) host block pool instead of being recomputed.

- host_block_pool: cpu block ids, free list, ref counts, hash index (plain Python)
- policy: swap or recompute, per victim (plain Python)
- host_kv_cache: the host tensors (torch)
- copy_engine: streams, events and transfers in flight (torch)
"""
