"""Parallel sampling (SamplingParams.n and best_of), vLLM v1's way: a prompt fans out into one sequence per sample,
and the samples come back together as one RequestOutput (plain Python; no torch).

The samples share the prompt's KV through the GPU prefix cache: they are queued together, the first one's prompt
blocks get their hashes when its prefill is scheduled, and the others, admitted after it (in the same step when the
budget allows), take references on those full blocks instead of computing them (BlockManager.allocate). Each sample
computes only the block of its last prompt token, which it then fills with its own tokens. So a prompt of L tokens
and n samples holds (L - 1) // block_size + n GPU blocks after its prefill, not n * ceil(L / block_size). With
enable_prefix_caching=False nothing is shared. Swap-out and the host tier find blocks by the same hashes, so a shared
block is copied to the host once, however many samples are swapped out (HostBlockPool.swap_out).
"""
from dataclasses import dataclass, replace

from nanovllm.sampling_params import SamplingParams


@dataclass
class PromptRequest:
    """One prompt of a generate / generate_stream call and the sequences that sample it."""
    request_id: str  # RequestOutput.request_id: the first sample's seq id, as a string
    prompt: str | None  # the prompt's text; None when given as token ids
    params: SamplingParams  # the request's own, with its n and best_of
    seq_ids: list[int]  # one per sample, in sample order


def sample_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per sequence to generate (best_of, else n of them), each with n=1:
    - sample i of a seeded request gets seed + i (vLLM's rule), so it repeats alone with that seed, token for
      token;
    - with best_of > n the samples compute their tokens' logprobs (0 alternatives at least), since they are ranked
      by their sum; the RequestOutput shows them only when the request asked for logprobs;
    - only the first sample computes the prompt's logprobs (they are the same for all), so the others can take
      the prompt's blocks from the prefix cache."""
    if params.num_samples == 1:
        return [params]
    logprobs = params.logprobs
    if logprobs is None and params.num_samples > params.n:
        logprobs = 0
    return [replace(params, n=1, best_of=None, logprobs=logprobs,
                    seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            for i in range(params.num_samples)]
