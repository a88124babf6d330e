"""How many GPU KV blocks a memory budget buys. The bytes of one block, the block-major tensor and each layer's
views are the KV layout's (nanovllm/layers/kv_layout.py); the runner owns the tensor."""
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from nanovllm.config import Config
from nanovllm.core.memory_plan import format_breakdown, plan_kv_blocks

GiB = 1 << 30
# the CPU's default KV: this fraction of the memory available at start-up, at most CPU_KV_MAX_BYTES (vLLM's CPU
# default, VLLM_CPU_KVCACHE_SPACE=4), and never more than max_num_seqs sequences of max_model_len could use. The
# pages are the OS's until a block is written (kv_layout.allocate), so the cache costs what the work fills
CPU_KV_MEMORY_FRACTION = 0.1
CPU_KV_MAX_BYTES = 4 * GiB

logger = logging.getLogger(__name__)


def max_useful_blocks(config: Config) -> int:
    """What max_num_seqs sequences of max_model_len tokens could use."""
    blocks_per_seq = (config.max_model_len + config.kvcache_block_size - 1) // config.kvcache_block_size
    return config.max_num_seqs * blocks_per_seq


def num_blocks_for_budget(config: Config, block_bytes: int, device: torch.device,
                          profile_memory: Callable[[], dict], num_ranks: int) -> tuple[int, dict | None]:
    """GPU blocks from kv_cache_memory_bytes or, on CUDA, from the measured terms of a profiling run
    (`profile_memory`, see memory_profile.py) under gpu_memory_utilization of the card or the budget (plan_kv_blocks;
    on CPU, cpu_kv_blocks); capped by num_kvcache_blocks and by max_useful_blocks. With
    tensor parallelism every rank takes the smallest, so all hold the same block ids. Returns (num_blocks, where the
    memory went: plan_kv_blocks' breakdown, None without a profiling run)."""
    max_blocks = max_useful_blocks(config)
    if config.num_kvcache_blocks is not None:  # an explicit cap
        max_blocks = min(max_blocks, config.num_kvcache_blocks)
    breakdown = None
    if config.kv_cache_memory_bytes is not None:
        num_blocks = min(config.kv_cache_memory_bytes // block_bytes, max_blocks)
    elif device.type == "cuda":
        measured = profile_memory()
        num_blocks, breakdown = plan_kv_blocks(
            measured["card_bytes"], config.gpu_memory_utilization, measured["weights_bytes"],
            measured["activation_peak_bytes"], measured["graph_pool_bytes"], measured["non_torch_bytes"],
            block_bytes, max_blocks)
    else:
        num_blocks = cpu_kv_blocks(block_bytes, max_blocks)
    if num_ranks > 1:
        t = torch.tensor([int(num_blocks)], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        num_blocks = int(t.item())
        if breakdown is not None and num_blocks < breakdown["num_blocks"]:  # another rank had less room
            breakdown["left_free"] += (breakdown["num_blocks"] - num_blocks) * block_bytes
            breakdown.update(num_blocks=num_blocks, kv=num_blocks * block_bytes)
    if num_blocks < 1:
        if config.kv_cache_memory_bytes is not None:
            hint = f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is less than that; raise it"
        else:
            hint = ("raise gpu_memory_utilization or gpu_memory_budget_gib, or lower max_num_batched_tokens or "
                    f"max_num_seqs (the profiling run's size); {format_breakdown(breakdown) if breakdown else ''}")
        raise ValueError(f"no room for a single KV block of {block_bytes:,} bytes: {hint}")
    if breakdown is None:  # a profiling run logs its breakdown instead (llm_engine.py)
        log_kv_size(config, int(num_blocks), block_bytes, device)
    return int(num_blocks), breakdown


def cpu_kv_blocks(block_bytes: int, max_blocks: int) -> int:
    """The CPU's default: CPU_KV_MEMORY_FRACTION of the available memory, at most CPU_KV_MAX_BYTES and max_blocks."""
    import psutil
    budget_bytes = min(CPU_KV_MAX_BYTES, int(psutil.virtual_memory().available * CPU_KV_MEMORY_FRACTION))
    return min(budget_bytes // block_bytes, max_blocks)


def log_kv_size(config: Config, num_blocks: int, block_bytes: int, device: torch.device):
    """One start-up line: the KV cache's size and the rule that gave it."""
    if config.kv_cache_memory_bytes is not None:
        rule = f"kv_cache_memory_bytes={config.kv_cache_memory_bytes}"
    elif config.num_kvcache_blocks is not None:
        rule = f"num_kvcache_blocks={config.num_kvcache_blocks}"
    else:
        rule = (f"{CPU_KV_MEMORY_FRACTION:.0%} of the available memory, at most {CPU_KV_MAX_BYTES / GiB:g} GiB; "
                f"kv_cache_memory_bytes sets it")
    rule += f"; at most what max_num_seqs={config.max_num_seqs} x max_model_len={config.max_model_len} can use"
    where = "RAM, taken as blocks are written" if device.type == "cpu" else device.type
    logger.info("KV cache: %d blocks of %d tokens, %.3f GiB on %s (%s)", num_blocks, config.kvcache_block_size,
                num_blocks * block_bytes / GiB, where, rule)
