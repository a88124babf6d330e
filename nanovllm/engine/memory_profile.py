"""What the KV cache must leave room for on a GPU, measured once at start-up: the budget's cap on PyTorch's
allocator, the weights, the activation peak of the largest step, the CUDA graph pools and CUDA's own memory. The
arithmetic that turns these into blocks is nanovllm/core/memory_plan.py.

Graph pools: the graphs are captured after the KV cache is allocated (they read it), so their pool cannot be
measured before sizing. It is reserved as the activation peak of an eager forward of the largest captured step
(GraphRunner.largest_graph_tokens: a graph's pool holds that step's intermediates, shared by all graphs, which never
run at once); after capture the runner measures the real pool (graph_pool_bytes_measured) and the start-up log
prints both.
"""
import ctypes
import logging

import torch

from nanovllm.config import budget_bytes
from nanovllm.core.memory_plan import GiB
from nanovllm.layers.logprobs import logprobs_of
from nanovllm.layers.quantization.method import quant_matmul
from nanovllm.layers.sampler import SamplingTensors
from nanovllm.utils.context import AttentionMetadata, reset_context, set_context
from nanovllm.utils.nvml import process_gpu_bytes
from nanovllm.utils.switches import SWITCHES

logger = logging.getLogger(__name__)


def non_torch_bytes(config, device: torch.device) -> int:
    """GPU memory outside PyTorch's allocator that the card or the budget must hold: the CUDA context, loaded
    kernels, NCCL buffers. Under gpu_memory_budget_gib, this process's alone where NVML lists it: a budget is the
    engine's own, so engines that share a GPU with a budget each (pytest-xdist's workers, for one) do not count
    each other's memory against it. Otherwise, or where NVML cannot say, all of the GPU's memory that is not this
    process's PyTorch memory, other processes' included: the card counts them as taken."""
    reserved = torch.cuda.memory_reserved(device)
    if config.gpu_memory_budget_gib is not None:
        own = process_gpu_bytes(f"GPU-{torch.cuda.get_device_properties(device).uuid}")
        if own is not None:
            return max(0, own - reserved)
    free, total = torch.cuda.mem_get_info(device)
    return total - free - reserved


CU_LIMIT_STACK_SIZE = 0  # the driver API's CUlimit


def release_stack_reservation(device: torch.device) -> bool:
    """Give back the memory CUDA reserves for per-thread stacks; True where it did.

    The driver keeps stack_limit x (threads an SM can hold) x SMs of local memory whether a kernel uses it or not:
    1 KiB x 2,048 x 132 = 264 MiB on an H100, 54 MiB on a 36-SM laptop part, all of it taken from the KV cache.
    Few of the engine's kernels need a stack at all (torch's sort takes 256 bytes). A limit of 0 frees it: the
    driver raises the limit at the launch of any kernel that needs more (a spill, a printf) and keeps it raised, so
    no kernel fails for it, and the profiling run's kernels have raised it to what they need before the sizing
    measures CUDA's own memory.
    NANOVLLM_CUDA_STACK=0 leaves the driver's default."""
    if not SWITCHES.release_cuda_stack or device.type != "cuda":
        return False
    torch.cuda.mem_get_info(device)  # the primary context exists and is current on this thread
    driver = _driver()
    if driver is None:
        return False
    rc = driver.cuCtxSetLimit(CU_LIMIT_STACK_SIZE, ctypes.c_size_t(0))
    if rc != 0:
        logger.debug("cuCtxSetLimit(stack size, 0) returned %d; the per-thread stack reservation stays", rc)
    return rc == 0


def stack_limit_bytes(device: torch.device) -> int | None:
    """CUDA's per-thread stack limit now (what the kernels launched so far raised it to); None where unknown."""
    driver = _driver() if device.type == "cuda" else None
    value = ctypes.c_size_t()
    if driver is None or driver.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_STACK_SIZE) != 0:
        return None
    return value.value


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")  # already loaded by the CUDA runtime: the same library and context
    except OSError:  # a CUDA without the driver library under its usual name: keep the default
        logger.debug("libcuda.so.1 not found; the per-thread stack limit stays the driver's")
        return None


def card_bytes(config, device: torch.device) -> int:
    """The GPU's memory, or the budget when that is smaller."""
    total = torch.cuda.mem_get_info(device)[1]
    budget = budget_bytes(config.gpu_memory_budget_gib)
    return total if budget is None else min(total, budget)


def apply_budget(config, device: torch.device):
    """Cap PyTorch's allocator so that torch's memory plus CUDA's own stays inside gpu_memory_budget_gib. Called
    before anything is allocated and again after profiling, when the kernels loaded by then count too. ValueError
    where the budget leaves nothing for PyTorch, or is more than this process can get beside other processes."""
    if config.gpu_memory_budget_gib is None or device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    budget, outside_torch = card_bytes(config, device), non_torch_bytes(config, device)
    torch_bytes = budget - outside_torch
    if torch_bytes <= 0:
        raise ValueError(f"gpu_memory_budget_gib={config.gpu_memory_budget_gib} leaves nothing for PyTorch: CUDA "
                         f"already holds {outside_torch / GiB:.2f} GiB; raise gpu_memory_budget_gib")
    reachable = free + torch.cuda.memory_reserved(device) + outside_torch
    if budget > reachable:
        raise ValueError(f"gpu_memory_budget_gib={config.gpu_memory_budget_gib} is more than this process can get "
                         f"on {device}: {free / GiB:.2f} GiB free, other processes hold the rest of its "
                         f"{total / GiB:.2f} GiB; lower gpu_memory_budget_gib")
    torch.cuda.set_per_process_memory_fraction(min(1.0, torch_bytes / total), device)


# The share of the card's memory (or of the budget, when smaller) that the large-M "int" path's dequantized-weight
# scratch may take: 1% of an 80 GB card (800 MB) holds any layer of an 8B model whole, so it dequantizes in one pass
# (chunks cost time: each chunk's GEMM is narrower); 1% of 8 GiB (82 MiB) chunks Qwen3-8B's gate_up (192 MiB in bf16)
# and down_proj (96 MiB), whose whole copies would sit at the activation peak and in every graph pool, taking KV.
DEQUANT_SCRATCH_SHARE = 0.01


def bound_dequant_scratch(config, device: torch.device) -> int | None:
    """Give the quantized kernels their scratch bound (quant_matmul.set_dequant_scratch_max_bytes) from the card's
    memory or the budget; called once at start-up, before the memory is profiled. None where no kernel runs."""
    if device.type != "cuda" or quant_matmul is None:
        return None
    max_bytes = int(card_bytes(config, device) * DEQUANT_SCRATCH_SHARE)
    quant_matmul.set_dequant_scratch_max_bytes(max_bytes)
    return max_bytes


@torch.inference_mode()
def profile_memory(runner) -> dict:
    """Measured terms for plan_kv_blocks (bytes): card, weights, activation peak, graph pools, non-torch."""
    config, device = runner.config, runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights_bytes = torch.cuda.memory_allocated(device)
    runner.warmup_sampler()  # small batches first: torch.compile specializes on the first size it sees
    seq_len = min(config.max_num_batched_tokens, config.max_model_len)
    num_tokens = seq_len * min(config.max_num_batched_tokens // seq_len, config.max_num_seqs)
    activation_peak = _peak_bytes(runner, num_tokens, seq_len, config.max_num_seqs, sample=True)
    graph_pools = 0
    graph_tokens = runner.graph_runner.largest_graph_tokens()  # 0: no graphs
    if graph_tokens:
        seq_len = min(graph_tokens, config.max_model_len)
        # whole sequences for the profile's attention (a max_model_len that does not divide the bucket): rounded
        # up, by less than one sequence, so the reserve errs high
        num_tokens = -(-graph_tokens // seq_len) * seq_len
        graph_pools = _peak_bytes(runner, num_tokens, seq_len, 1, sample=False)
    torch.cuda.empty_cache()
    apply_budget(config, device)
    return dict(card_bytes=card_bytes(config, device), weights_bytes=weights_bytes,
                activation_peak_bytes=activation_peak, graph_pool_bytes=graph_pools,
                non_torch_bytes=non_torch_bytes(config, device))


def _peak_bytes(runner, num_tokens: int, seq_len: int, num_rows: int, sample: bool) -> int:
    """Bytes above what is allocated now at the peak of one step without a KV cache (profile_step)."""
    device = runner.device
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    profile_step(runner.model, runner.sampler, device, num_tokens, seq_len, num_rows, sample,
                 runner.config.max_logprobs)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def profile_step(model, sampler, device: torch.device, num_tokens: int, seq_len: int, num_rows: int, sample: bool,
                 max_logprobs: int):
    """One step without a KV cache: num_tokens packed as seq_len-long sequences, logits for the last num_rows rows
    and, with `sample`, the sampler with top-k/top-p and the logprobs of every row. Keeps nothing alive after it
    (benchmarks/activation_peak.py counts its peak without a GPU)."""
    positions = torch.arange(num_tokens, device=device) % seq_len
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    set_context(AttentionMetadata(False, None, None, None, max_seq_len=seq_len))
    try:
        hidden = model(input_ids, positions)
        logits = model.compute_logits(hidden[-num_rows:])
    finally:
        reset_context()
    del hidden
    if sample:
        rows = logits.size(0)
        tensors = SamplingTensors(torch.full((rows,), 0.7, device=device),
                                  torch.full((rows,), 50, dtype=torch.int64, device=device),
                                  torch.full((rows,), 0.9, device=device), None, None, all_greedy=False)
        raw_rows = logits.clone()  # as the runner keeps the logprob rows' raw logits beside the sampler's
        logprobs_of(raw_rows, sampler(logits, tensors), min(max_logprobs, logits.size(1)))
        del raw_rows
    del logits
