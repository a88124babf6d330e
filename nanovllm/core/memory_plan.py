"""Where a GPU's memory goes, and how many KV blocks are left (plain arithmetic; no torch, so CPU tests and
bench_swap.py --simulate size the cache with the same rule the engine runs on the GPU).

Rule: KV bytes = gpu_memory_utilization x card - weights - activation peak - CUDA graph pools - non-torch memory,
where "card" is the smaller of the GPU's memory and the budget (gpu_memory_budget_gib). Each term is measured once
by the runner (model_runner.py: profile_memory) and counted once here.
"""
GiB = 1 << 30


def plan_kv_blocks(card_bytes: int, gpu_memory_utilization: float, weights_bytes: int, activation_peak_bytes: int,
                   graph_pool_bytes: int, non_torch_bytes: int, block_bytes: int,
                   max_blocks: int | None = None) -> tuple[int, dict]:
    """Returns (num_blocks, breakdown): the blocks that fit, at most max_blocks, and where the card's bytes go
    (weights, activation_peak, graph_pools, non_torch, kv, left_free; plus card and usable). num_blocks may be 0:
    the caller says why that is an error."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes} must be >= 1")
    usable_bytes = int(card_bytes * gpu_memory_utilization)
    spent_bytes = weights_bytes + activation_peak_bytes + graph_pool_bytes + non_torch_bytes
    num_blocks = max(0, (usable_bytes - spent_bytes) // block_bytes)
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    kv_bytes = num_blocks * block_bytes
    breakdown = {
        "card": card_bytes, "usable": usable_bytes, "weights": weights_bytes,
        "activation_peak": activation_peak_bytes, "graph_pools": graph_pool_bytes, "non_torch": non_torch_bytes,
        "kv": kv_bytes, "left_free": card_bytes - spent_bytes - kv_bytes, "num_blocks": num_blocks,
    }
    return num_blocks, breakdown


def format_breakdown(breakdown: dict) -> str:
    """The start-up log line: where the card's memory went, in GiB."""
    g = {k: v / GiB for k, v in breakdown.items() if k != "num_blocks"}
    return (f"GPU memory (GiB): card {g['card']:.2f}, usable {g['usable']:.2f}; weights {g['weights']:.2f}, "
            f"activation peak {g['activation_peak']:.2f}, graph pools {g['graph_pools']:.2f}, "
            f"other (non-torch) {g['non_torch']:.2f}, KV {g['kv']:.2f} ({breakdown['num_blocks']} blocks), "
            f"left free {g['left_free']:.2f}")
