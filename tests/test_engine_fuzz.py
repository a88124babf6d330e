"""Random workloads through the whole engine on the CPU: random prompts (some sharing a prefix) and lengths, a GPU
KV cache just big enough for the longest sequence, every preemption mode, tiny host pools, the three host-cache
policies, chunked prefill, asynchronous scheduling. Greedy outputs must equal those of an unpressured synchronous
run without prefix caching, token for token. (200 such cases were run while hunting for a swap-in bug the
unit tests had missed; these seeds keep a sample of them.)"""
import random

import pytest

from conftest import close_llm, greedy
from nanovllm import LLM


def run(model_dir, prompts, params, **kwargs):
    llm = LLM(model_dir, **{**dict(device="cpu", dtype="float32", max_model_len=256, enforce_eager=True, seed=0),
                            **kwargs})
    try:
        return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)], llm.stats()
    finally:
        close_llm(llm)


def random_case(seed: int):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 500) for _ in range(rng.choice([0, 8, 20, 40]))]
    prompts = [(prefix if rng.random() < 0.6 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]
               for _ in range(rng.randint(3, 12))]
    params = [greedy(rng.randint(1, 40)) for _ in prompts]
    block_size = rng.choice([4, 8, 16])
    longest = max(-(-(len(p) + q.max_tokens) // block_size) for p, q in zip(prompts, params))
    pressure = dict(kvcache_block_size=block_size, num_kvcache_blocks=longest + rng.randint(0, 8),
                    max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.choice([16, 32, 64, 512]),
                    preemption_mode=rng.choice(["swap", "recompute", "auto"]),
                    swap_space=rng.choice([0.0001, 0.001, 0.01]),
                    host_cache_policy=rng.choice(["off", "write_back", "write_through"]),
                    enable_prefix_caching=rng.random() < 0.8, async_scheduling=rng.random() < 0.7)
    if pressure["max_num_batched_tokens"] < pressure["max_num_seqs"]:
        pressure["max_num_batched_tokens"] = 512
    return prompts, params, pressure


@pytest.mark.slow  # 8 random configurations, two engines each
@pytest.mark.parametrize("seed", range(8))
def test_random_pressure_gives_the_unpressured_tokens(tiny_dirs, seed):
    prompts, params, pressure = random_case(seed)
    model_dir = tiny_dirs["qwen3" if seed % 2 else "llama"]
    ref, _ = run(model_dir, prompts, params, max_num_seqs=16, num_kvcache_blocks=400, kvcache_block_size=16,
                 enable_prefix_caching=False, async_scheduling=False)
    got, stats = run(model_dir, prompts, params, **pressure)
    assert got == ref, (pressure, stats)
