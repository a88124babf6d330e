"""Parallel sampling's metadata (no torch): the samples of a prompt share its full prompt blocks through the GPU
prefix cache, counted once, and the swap tier moves a shared block once; how a request fans out into samples.

Block size 4; a prompt of 10 tokens has 2 full blocks before the block of its last token."""
import pytest

from metadata_factories import BLOCK_SIZE, check, make_scheduler, run_step
from nanovllm.core.sequence import Sequence
from nanovllm.engine.parallel_sampling import sample_params
from nanovllm.sampling_params import SamplingParams

PROMPT = list(range(100, 110))  # 10 tokens: blocks [100..103] [104..107] full, [108, 109] the last token's


def samples(n: int, prompt=PROMPT, **options) -> list[Sequence]:
    params = SamplingParams(n=n, seed=5, max_tokens=8, ignore_eos=True, **options)
    return [Sequence(prompt, child, BLOCK_SIZE) for child in sample_params(params)]


def num_used_blocks(s) -> int:
    return s.block_manager.num_blocks - s.block_manager.num_free_blocks


def test_the_samples_of_a_prompt_share_its_full_blocks_counted_once():
    s = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=None)
    seqs = samples(4)
    for seq in seqs:
        s.add(seq)
    out, _ = run_step(s)
    # the first sample computes the prompt; its two full blocks are cached when scheduled, so the other three,
    # admitted after it in the same step, take references on them and compute only their last block
    assert sorted(out.num_new_tokens) == [2, 2, 2, 10]
    shared = seqs[0].block_table[:2]
    assert all(seq.block_table[:2] == shared for seq in seqs)
    own = [seq.block_table[2] for seq in seqs]
    assert len(set(own)) == 4 and not set(own) & set(shared)
    assert [s.block_manager.ref_counts[b] for b in shared] == [4, 4]
    assert num_used_blocks(s) == 2 + 4  # not 4 * 3: the shared prompt blocks count once
    assert s.stats.prefix_cache_hit_tokens == 3 * 2 * BLOCK_SIZE and s.stats.prefill_tokens == 10 + 3 * 2
    for _ in range(2):  # decodes write into each sample's own block: nothing new is allocated
        run_step(s)
    assert num_used_blocks(s) == 6


def test_without_prefix_caching_nothing_is_shared():
    s = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=None, prefix_caching=False)
    seqs = samples(4)
    for seq in seqs:
        s.add(seq)
    run_step(s)
    assert num_used_blocks(s) == 4 * 3


def test_the_swap_tier_moves_a_shared_block_once():
    """All four samples swapped out: the two shared blocks cross to the host once (the host pool finds them by
    hash for the next three), each sample's own block once; back on the GPU, the shared blocks are found in the
    GPU prefix cache and need no copy at all."""
    s = make_scheduler(num_gpu_blocks=16, num_cpu_blocks=16, mode="swap")
    seqs = samples(4)
    for seq in seqs:
        s.add(seq)
    run_step(s)
    shared = seqs[0].block_table[:2]
    own = [seq.block_table[2] for seq in seqs]
    for seq in seqs:
        s.preempt(seq, mode="swap")
        check(s)
    assert s.block_manager.num_free_blocks == 16  # every block released on the GPU
    host = s.host_pool
    assert host.num_blocks - host.num_free_blocks == 2 + 4  # the host holds the shared blocks once
    assert len({seq.cpu_block_table[0] for seq in seqs}) == 1 and len({seq.cpu_block_table[1] for seq in seqs}) == 1
    out, _ = run_step(s)
    copied = [gpu_block_id for gpu_block_id, _ in out.swap_out]
    assert sorted(copied) == sorted(shared + own)  # each block copied out once
    assert all(seq.block_table[:2] == shared for seq in seqs)  # resumed: the shared blocks, from the GPU cache
    assert len(out.swap_in) == 4  # only the samples' own blocks come back
    assert num_used_blocks(s) == 6


def test_a_request_fans_out_into_samples():
    params = SamplingParams(n=2, best_of=3, seed=10, prompt_logprobs=1, max_tokens=4)
    children = sample_params(params)
    assert [c.seed for c in children] == [10, 11, 12]  # vLLM's rule: sample i gets seed + i
    assert all(c.n == 1 and c.best_of is None for c in children)
    assert [c.logprobs for c in children] == [0, 0, 0]  # ranked by cumulative logprob: computed, shown only if asked
    assert [c.prompt_logprobs for c in children] == [1, None, None]  # once: the others may hit the prefix cache
    unseeded = sample_params(SamplingParams(n=3))
    assert [c.seed for c in unseeded] == [None] * 3 and [c.logprobs for c in unseeded] == [None] * 3
    single = SamplingParams(seed=3)
    assert sample_params(single) == [single]  # n=1: the request's own params, its seed unchanged


@pytest.mark.parametrize("options, message", [
    ({"n": 0}, "n=0 must be an int >= 1"),
    ({"n": 2, "best_of": 1}, "best_of=1 must be None or an int >= n=2"),
    ({"n": 1.5}, "n=1.5"),
])
def test_bad_n_and_best_of_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SamplingParams(**options)
