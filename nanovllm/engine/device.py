"""Where and in which dtype a model runs: the device and dtype options resolved against this machine."""
import logging

import torch

from nanovllm.config import budget_bytes, small_card_batch_limits
from nanovllm.core.memory_plan import GiB

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; use device='cpu' or 'auto'")
    return torch.device(name)


def card_memory_bytes(device_option, budget_gib) -> int | None:
    """The memory of the GPU rank 0 will run on, or the budget (gpu_memory_budget_gib) when that is smaller; None
    on the CPU. Read before the options are checked, so it asks nothing of options Config will reject."""
    if device_option not in ("auto", "cuda") or not torch.cuda.is_available():
        return None
    try:
        total = torch.cuda.get_device_properties(0).total_memory  # rank 0 runs on cuda:0 (model_runner.py)
    except (RuntimeError, AssertionError):  # a CUDA that cannot answer: Config's defaults; the runner says why
        return None
    budget = budget_bytes(budget_gib)
    return total if budget is None else min(total, budget)


def with_card_batch_limits(engine_kwargs: dict) -> dict:
    """The engine options with the batch limits of the card they will run on (small_card_batch_limits) where the
    caller passed none: on a card under 70 GiB, vLLM's smaller max_num_seqs and max_num_batched_tokens."""
    card_bytes = card_memory_bytes(engine_kwargs.get("device", "auto"), engine_kwargs.get("gpu_memory_budget_gib"))
    limits = small_card_batch_limits(engine_kwargs, card_bytes)
    if limits:
        logger.info("%.1f GiB of GPU memory (under 70 GiB): %s, the defaults for such cards", card_bytes / GiB,
                    ", ".join(f"{k}={v}" for k, v in limits.items()))
    return {**engine_kwargs, **limits}


# the options that ask for the host tier; on the CPU, without one of them (or kv_disk_path, whose hits load into the
# host pool), there is none (with_cpu_host_tier_default)
HOST_TIER_OPTIONS = ("swap_space", "preemption_mode", "host_cache_policy")


def runs_on_cpu(device_option) -> bool:
    """Whether the engine will run on the CPU; False for an option Config will refuse (it says why)."""
    return device_option == "cpu" or (device_option == "auto" and not torch.cuda.is_available())


def with_cpu_host_tier_default(engine_kwargs: dict) -> dict:
    """The engine options with swap_space=0 on the CPU unless they ask for the host tier. On the CPU the "device" KV
    cache and the host pool are the same RAM: swapping copies a block from one part of it to another, and the host
    prefix cache keeps a second copy of blocks the KV cache could have kept itself, so the memory does more as a
    larger KV cache (kv_cache_memory_bytes). The tier still runs there when asked for (its tests do)."""
    if (any(name in engine_kwargs for name in HOST_TIER_OPTIONS) or engine_kwargs.get("kv_disk_path") is not None
            or not runs_on_cpu(engine_kwargs.get("device", "auto"))):
        return engine_kwargs
    logger.info("CPU: no host tier (host and device memory are the same RAM); pass swap_space to have one")
    return {**engine_kwargs, "swap_space": 0}


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """The model's dtype. "auto": float32 on CPU; on CUDA the checkpoint's half type, bfloat16 when it has none, and
    float16 instead of bfloat16 on GPUs before compute capability 8.0 (T4, V100, RTX 20-series), which have no
    bfloat16 arithmetic, as vLLM does."""
    bf16_ok = device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 0)
    if name != "auto":
        if DTYPES[name] == torch.bfloat16 and not bf16_ok:
            raise ValueError(f"dtype='{name}': {torch.cuda.get_device_name(device)} (compute capability "
                             f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) has no bfloat16 "
                             f"arithmetic, which needs 8.0 or newer; use dtype='float16' (or 'auto')")
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or torch.bfloat16
    dtype = DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if dtype == torch.bfloat16 and not bf16_ok:
        logger.warning("%s has no bfloat16 arithmetic (compute capability < 8.0): running the model in float16",
                       torch.cuda.get_device_name(device))
        return torch.float16
    return dtype
