"""The prefill speed the host tier's policy starts from: one timed prefill at start-up, so that the first admission's
disk hits (and the first preemptions) are decided on a measurement of this GPU and model rather than on a prior
(docs/disk_tier.md, "Load or recompute")."""
import logging
import time

import torch

from nanovllm.engine.graph_runner import MAX_MIXED_GRAPH_TOKENS

logger = logging.getLogger(__name__)
PROBE_MAX_TOKENS = MAX_MIXED_GRAPH_TOKENS  # a step this size replays the largest piecewise graph (graph_runner.py)
PROBE_NUM_SEQS = 4  # a few fresh sequences, as the first admissions after a restart bring


@torch.inference_mode()
def measure_prefill_tokens_per_s(runner, clock=time.perf_counter) -> float | None:
    """Prompt tokens per second of one prefill step of min(max_num_batched_tokens, 2,048) tokens in 4 fresh
    sequences, run after the warm-up and graph capture (so through the same piecewise graph or eager path a step of
    that size takes later). The step runs twice and only the second is timed, between two synchronizes: the first
    absorbs any compile of a shape the warm-up did not meet. None when the KV cache cannot hold the step.

    Start-up cost: those two forwards, about 4 x 2,048 x (number of parameters) FLOP: milliseconds for a small model
    on a data-centre GPU. The prefills write into blocks that are all still free (runner.warmup_plan), as the
    warm-up's do; nothing reads them before their next owner overwrites them."""
    config, block_size = runner.config, runner.block_size
    num_blocks_per_seq = runner.kv_cache.size(0) // PROBE_NUM_SEQS
    num_tokens_per_seq = min(min(config.max_num_batched_tokens, PROBE_MAX_TOKENS) // PROBE_NUM_SEQS,
                             config.max_model_len, num_blocks_per_seq * block_size)
    if num_tokens_per_seq < 1:
        return None
    plan = runner.warmup_plan([num_tokens_per_seq] * PROBE_NUM_SEQS)
    runner.forward(plan)
    _synchronize(runner.device)
    start = clock()
    runner.forward(plan)
    _synchronize(runner.device)
    seconds = clock() - start
    if seconds <= 0:
        return None
    tokens_per_s = plan.num_tokens / seconds
    if runner.rank == 0:
        logger.info("prefill speed measured at start-up: %.0f tokens/s (%d tokens in %d sequences in %.2f ms); the "
                    "host tier's policy starts from it", tokens_per_s, plan.num_tokens, PROBE_NUM_SEQS, seconds * 1e3)
    return tokens_per_s


def _synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
