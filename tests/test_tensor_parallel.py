"""Tensor parallelism on CPU with gloo: TP=N gives TP=1's greedy tokens, with and without forced swapping, and
leaves no process behind."""
import multiprocessing as mp

import pytest

from conftest import close_llm, greedy, random_prompts, smollm2_llm_kwargs, tiny_llm_kwargs
from nanovllm import LLM

pytestmark = pytest.mark.subprocess  # tensor-parallel workers are processes

PROMPTS = random_prompts([3, 17, 40, 9, 33])


def run(model_dir, kwargs, prompts=PROMPTS, max_tokens=16):
    llm = LLM(model_dir, **kwargs)
    try:
        outs = [o["token_ids"] for o in llm.generate(prompts, greedy(max_tokens), use_tqdm=False)]
        return outs, llm.stats()
    finally:
        close_llm(llm)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama", "llama_bias"])
def test_tp2_equals_tp1(tiny_dirs, family):
    ref, _ = run(tiny_dirs[family], tiny_llm_kwargs())
    got, _ = run(tiny_dirs[family], tiny_llm_kwargs(tensor_parallel_size=2))
    assert got == ref
    assert mp.active_children() == []


def test_tp2_with_forced_swapping_equals_tp1(qwen3_dir):
    ref, _ = run(qwen3_dir, tiny_llm_kwargs())
    got, stats = run(qwen3_dir, tiny_llm_kwargs(tensor_parallel_size=2, num_kvcache_blocks=24,
                                                 preemption_mode="swap", swap_space=0.01))
    assert got == ref
    assert stats["preemptions_swap"] > 0 and stats["blocks_swapped_in"] > 0 and stats["recomputed_tokens"] == 0
    # both ranks moved their shard of each block: 2 layers x K,V x 4 tokens x 1 KV head x 32 dims x 4 bytes each
    assert stats["bytes_swapped_out"] == stats["blocks_swapped_out"] * 2 * (2 * 2 * 4 * 1 * 32 * 4)


def test_smollm2_tp3_equals_tp1(smollm2_dir):
    """9 query heads and 3 KV heads: one KV head per rank. (1 GiB of host pool per rank: the default 4 x 3 ranks
    is refused when another process holds half of a 24 GiB machine, as it once did during a CI run.)"""
    prompts = random_prompts([12, 30], vocab=49152)
    ref, _ = run(smollm2_dir, smollm2_llm_kwargs(), prompts, 8)
    got, _ = run(smollm2_dir, smollm2_llm_kwargs(tensor_parallel_size=3, swap_space=1), prompts, 8)
    assert got == ref
    assert mp.active_children() == []


def test_heads_not_divisible_is_a_value_error(qwen3_dir):
    with pytest.raises(ValueError, match="not divisible by tensor_parallel_size=3"):
        LLM(qwen3_dir, **tiny_llm_kwargs(tensor_parallel_size=3))
    assert mp.active_children() == []


def test_bad_config_fails_before_any_worker_starts(qwen3_dir):
    with pytest.raises(ValueError):
        LLM(qwen3_dir, **tiny_llm_kwargs(tensor_parallel_size=2, num_kvcache_blocks=0))
    assert mp.active_children() == []


def test_tp2_host_prefix_cache_hits_equal_tp1(qwen3_dir):
    """Each rank keeps its shard of the same host blocks: history evicted from the GPU comes back from the host."""
    from conftest import shared_prefix_prompts
    prompts = shared_prefix_prompts(48, [5, 9])

    def run_turns(tp: int):
        llm = LLM(qwen3_dir, **tiny_llm_kwargs(tensor_parallel_size=tp, num_kvcache_blocks=20, swap_space=0.01))
        try:
            outs = []
            for i, prompt in enumerate(prompts):
                outs.append(llm.generate([prompt], greedy(12), use_tqdm=False)[0]["token_ids"])
                llm.generate([[7 + i] * 75], greedy(4), use_tqdm=False)  # evicts everything on the GPU
            return outs, llm.stats()
        finally:
            close_llm(llm)

    ref, _ = run_turns(1)
    got, stats = run_turns(2)
    assert got == ref
    assert stats["host_prefix_hit_tokens"] == 48 and stats["prefix_cache_hit_tokens"] == 0
    assert mp.active_children() == []


def test_failed_tp_start_leaves_no_process_group(qwen3_dir, tmp_path):
    """A TP=2 start that fails after the ranks joined (a weight missing from the checkpoint) must leave this process
    outside any group: a TP=1 engine built next in the same process would otherwise shard itself for a dead peer."""
    import shutil

    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "missing-norm"
    shutil.copytree(qwen3_dir, bad)
    weights = load_file(bad / "model.safetensors")
    weights.pop("model.norm.weight")
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises((ValueError, RuntimeError), match="lacks weights"):  # rank 0's, or a worker's with its traceback
        LLM(str(bad), **tiny_llm_kwargs(tensor_parallel_size=2, async_scheduling=False))
    assert not dist.is_initialized()
    outs, _ = run(qwen3_dir, tiny_llm_kwargs(), prompts=PROMPTS[:1], max_tokens=4)
    assert outs == run(qwen3_dir, tiny_llm_kwargs(async_scheduling=True), prompts=PROMPTS[:1], max_tokens=4)[0]


def test_more_ranks_than_gpus_is_a_value_error(qwen3_dir, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs one GPU per rank, only 1 visible"):
        LLM(qwen3_dir, **tiny_llm_kwargs(device="cuda", tensor_parallel_size=2))
    assert mp.active_children() == []


def test_tp2_slices_the_mlp_of_a_large_step_as_tp1_runs_it_whole(qwen3_dir, tmp_path, monkeypatch):
    """A 2,100-token prompt in one step, over mlp_chunk_tokens=2048: each rank runs its MLP in two slices, and each
    slice's down_proj all-reduces its own rows of the residual stream. The tokens are TP=1's with the MLP whole."""
    import json
    import shutil

    import nanovllm.models.decoder as decoder
    model_dir = shutil.copytree(qwen3_dir, tmp_path / "qwen3-long")
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=4096)))
    prompt = random_prompts([2100], seed=3)
    kwargs = dict(max_model_len=2200, max_num_batched_tokens=2200, num_kvcache_blocks=600)
    ref, _ = run(str(model_dir), tiny_llm_kwargs(**kwargs), prompt, 4)  # mlp_chunk_tokens=None: whole
    slices = []
    add_rows = decoder.DecoderLayer._add_mlp_rows
    monkeypatch.setattr(decoder.DecoderLayer, "_add_mlp_rows",
                        lambda layer, residual: slices.append(residual.size(0)) or add_rows(layer, residual))
    got, _ = run(str(model_dir), tiny_llm_kwargs(tensor_parallel_size=2, mlp_chunk_tokens=2048, **kwargs), prompt, 4)
    assert got == ref
    assert slices[:2] == [2048, 52]  # rank 0's first layer of the prefill step
    assert mp.active_children() == []
