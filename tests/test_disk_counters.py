"""The disk tier's write counters in the run that wrote the blocks: the writes still queued when the engine closes
are finished by close(), and stats() after close() counts them."""
from __future__ import annotations

from conftest import random_prompts, tiny_llm_kwargs
from nanovllm import LLM, SamplingParams


def test_writes_finished_at_close_are_counted(qwen3_dir, tmp_path):
    prompts = random_prompts((13, 30, 7), seed=5)
    kwargs = tiny_llm_kwargs(kvcache_block_size=4, num_kvcache_blocks=64, swap_space=0.001,
                             host_cache_policy="write_back", kv_disk_path=str(tmp_path / "kv"))
    with LLM(qwen3_dir, **kwargs) as llm:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        # write-back: the last step's blocks reach the host, and then the disk, only at the next step or at close
        assert llm.stats()["blocks_written_to_disk"] == 0
    stats = llm.stats()
    # every full block of the three sequences (15, 32 and 9 tokens: 3 + 8 + 2 blocks of 4), written by close()
    assert stats["blocks_written_to_disk"] == 3 + 8 + 2, stats
    assert stats["disk_write_bytes"] > 0
