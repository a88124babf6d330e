"""The disk tier with the real engine (SmolLM2 on the CPU): a first process stores a prompt's KV blocks, and later
engines (this test process) find them, load them, and generate the same greedy tokens; a corrupted file, another
KV dtype and a slow disk each fall back to recomputing. The store itself: tests/test_disk_store.py."""
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import close_llm, random_prompts, smollm2_llm_kwargs
from nanovllm.core.hashing import hash_block

BLOCK_SIZE = 8  # smollm2_llm_kwargs
PROMPT = random_prompts([97], seed=31)[0]  # 12 full blocks and the last token: all 96 tokens before it can hit
NUM_HIT_TOKENS = (len(PROMPT) - 1) // BLOCK_SIZE * BLOCK_SIZE
MAX_TOKENS = 4
DISK_KWARGS = dict(swap_space=0.05, host_cache_policy="write_back", max_model_len=128, num_kvcache_blocks=32)

FIRST_RUN = """
import json, sys
sys.path.insert(0, {tests!r})
from conftest import smollm2_llm_kwargs
from nanovllm import LLM, SamplingParams
with LLM({model!r}, **smollm2_llm_kwargs(kv_disk_path={path!r}, **{disk_kwargs!r})) as llm:
    out = llm.generate([{prompt!r}], SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True),
                       use_tqdm=False)
    stats = llm.stats()
print(json.dumps({{"token_ids": out[0]["token_ids"], "prefill_tokens": stats["prefill_tokens"]}}))
"""


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, smollm2_dir):
    """A first engine, in its own process, run to completion and closed: its blocks are on disk."""
    path = str(tmp_path_factory.mktemp("kv_disk") / "kv")
    code = FIRST_RUN.format(tests=os.path.dirname(__file__), model=smollm2_dir, path=path, disk_kwargs=DISK_KWARGS,
                            prompt=PROMPT, max_tokens=MAX_TOKENS)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["prefill_tokens"] == len(PROMPT)
    return path, result["token_ids"]


@pytest.fixture
def disk_copy(first_run, tmp_path):
    """A copy of the first run's directory for one test to use (and spoil)."""
    path = str(tmp_path / "kv")
    shutil.copytree(first_run[0], path)
    return path


def generate(smollm2_dir, path, **overrides) -> tuple[list[int], dict]:
    from nanovllm import LLM, SamplingParams
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(kv_disk_path=path, **dict(DISK_KWARGS, **overrides)))
    try:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False)
        return out[0]["token_ids"], llm.stats()
    finally:
        close_llm(llm)


def block_file(path: str, block_index: int) -> str:
    h = 0
    for i in range(block_index + 1):
        h = hash_block(h, PROMPT[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
    [found] = glob.glob(os.path.join(path, "*", "??", f"{h:016x}.kvb"))
    return found


@pytest.mark.subprocess
def test_a_restarted_engine_loads_the_first_runs_blocks(smollm2_dir, first_run, disk_copy, caplog):
    with caplog.at_level("INFO", logger="nanovllm_offload.disk_tier"):
        token_ids, stats = generate(smollm2_dir, disk_copy)
    assert "disk tier: read speed measured at start-up" in caplog.text  # the probe's speed, size and time
    assert token_ids == first_run[1]
    assert stats["disk_hit_tokens"] == stats["disk_loaded_tokens"] == NUM_HIT_TOKENS
    assert stats["prefill_tokens"] <= 0.1 * len(PROMPT)
    assert stats["disk_read_bytes"] > 0 and stats["disk_skipped_tokens"] == stats["disk_corrupt_blocks"] == 0


@pytest.mark.subprocess
def test_a_corrupted_file_is_a_counted_miss(smollm2_dir, first_run, disk_copy):
    path = block_file(disk_copy, 2)
    with open(path, "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 100)
    token_ids, stats = generate(smollm2_dir, disk_copy)
    assert token_ids == first_run[1]
    assert stats["disk_corrupt_blocks"] == 1
    assert stats["disk_loaded_tokens"] == 2 * BLOCK_SIZE  # the blocks before the corrupt one
    assert stats["prefill_tokens"] == len(PROMPT) - 2 * BLOCK_SIZE
    with open(path, "rb") as f:  # removed, and stored again whole by this run's write-back
        f.seek(-100, os.SEEK_END)
        assert f.read() != b"\xff" * 100


@pytest.mark.subprocess
def test_another_kv_cache_dtype_never_hits(smollm2_dir, first_run, disk_copy):
    _, stats = generate(smollm2_dir, disk_copy, kv_cache_dtype="fp8")
    assert stats["disk_hit_tokens"] == stats["disk_loaded_tokens"] == 0
    assert stats["prefill_tokens"] == len(PROMPT)
    assert len(glob.glob(os.path.join(disk_copy, "*", "meta.json"))) == 2  # its own fingerprint directory


@pytest.mark.subprocess
def test_a_slow_disk_is_skipped(smollm2_dir, first_run, disk_copy, monkeypatch):
    import nanovllm.engine.engine_core as engine_core
    open_store = engine_core.open_disk_store

    def slow_store(*args, **kwargs):
        store = open_store(*args, **kwargs)
        store.read_bytes_per_s, store.ema, store.num_read_samples = 1e3, 0.0, 1  # 1 kB/s: any prefill beats it
        return store

    monkeypatch.setattr(engine_core, "open_disk_store", slow_store)
    token_ids, stats = generate(smollm2_dir, disk_copy)
    assert token_ids == first_run[1]
    assert stats["disk_hit_tokens"] == stats["disk_skipped_tokens"] == NUM_HIT_TOKENS
    assert stats["disk_loaded_tokens"] == 0  # (disk_read_bytes: only the start-up probe)
    assert stats["prefill_tokens"] == len(PROMPT)


@pytest.mark.subprocess
@pytest.mark.parametrize("seeded_tokens_per_s, is_loaded", [(100.0, True), (1e9, False)],
                         ids=["slow_prefill_loads", "fast_prefill_recomputes"])
def test_the_first_admission_decides_on_the_seeded_prefill_speed(smollm2_dir, first_run, disk_copy, monkeypatch,
                                                                 seeded_tokens_per_s, is_loaded):
    """A restart's hit comes at the first admission, before any prefill is timed: the rule compares the disk's read
    speed (fixed here at 1 GB/s: the 96 tokens' 4.4 MB in 4.4 ms) with the prefill speed the runner measured at
    start-up (stubbed: the CPU measures none, so its prior would decide). 100 tokens/s prefills them in 0.96 s: load;
    1G tokens/s in 0.1 us: recompute."""
    import nanovllm.engine.engine_core as engine_core
    from nanovllm.engine.model_runner import ModelRunner
    open_store = engine_core.open_disk_store

    def store_at_1_gb_per_s(*args, **kwargs):
        store = open_store(*args, **kwargs)
        store.read_bytes_per_s, store.ema, store.num_read_samples = 1e9, 0.0, 1  # pinned: no read moves it
        return store

    monkeypatch.setattr(engine_core, "open_disk_store", store_at_1_gb_per_s)
    monkeypatch.setattr(ModelRunner, "measure_prefill_speed", lambda self: seeded_tokens_per_s)
    token_ids, stats = generate(smollm2_dir, disk_copy)
    assert token_ids == first_run[1]
    assert stats["disk_hit_tokens"] == NUM_HIT_TOKENS
    assert stats["disk_loaded_tokens"] == (NUM_HIT_TOKENS if is_loaded else 0)
    assert stats["prefill_tokens"] == len(PROMPT) - stats["disk_loaded_tokens"]


@pytest.mark.subprocess
def test_cache_ls_and_clear(first_run, disk_copy, capsys):
    from nanovllm.entrypoints.cli import main
    assert main(["cache", "ls", "--kv-disk-path", disk_copy]) == 0
    listing = capsys.readouterr().out
    assert "SmolLM2" in listing and "1 fingerprint(s)" in listing
    assert main(["cache", "clear", "--kv-disk-path", disk_copy]) == 0
    assert "removed 1 fingerprint(s)" in capsys.readouterr().out
    assert not glob.glob(os.path.join(disk_copy, "*", "??", "*.kvb"))


@pytest.mark.parametrize("overrides, words", [
    (dict(kv_disk_gib=0), "kv_disk_gib=0"),
    (dict(swap_space=0), "swap_space > 0"),
    (dict(host_cache_policy="off"), "host_cache_policy"),
    (dict(tensor_parallel_size=2, async_scheduling=False), "tensor_parallel_size=1"),
])
def test_config_names_what_the_disk_tier_needs(smollm2_dir, tmp_path, overrides, words):
    from nanovllm.config import Config
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        Config(smollm2_dir, **smollm2_llm_kwargs(kv_disk_path=str(tmp_path), **dict(DISK_KWARGS, **overrides)))


def test_a_file_is_not_a_disk_path(smollm2_dir, tmp_path):
    from nanovllm.config import Config
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        Config(smollm2_dir, **smollm2_llm_kwargs(kv_disk_path=str(tmp_path / "f"), **DISK_KWARGS))


def test_a_swap_space_of_no_host_block_is_refused_with_a_disk_tier(smollm2_dir, tmp_path):
    """Without a disk tier such a pool makes every swap recompute (said once); a disk tier has nowhere to load."""
    from nanovllm import LLM
    with pytest.raises(ValueError, match=r"kv_disk_path needs host blocks to load into, but swap_space=1e-09 GiB "
                                         r"buys none of [0-9.e-]+ GiB; raise swap_space"):
        LLM(smollm2_dir, **smollm2_llm_kwargs(kv_disk_path=str(tmp_path / "kv"), **dict(DISK_KWARGS, swap_space=1e-9)))


def test_an_idle_engine_resets_its_prefix_caches_right_after_its_disk_writes(qwen3_dir, tmp_path):
    """The blocks a write holds are released when the reset asks, not at the next step (which an idle engine never
    takes): the reset is not refused, and every full block is on disk."""
    from conftest import tiny_llm_kwargs
    from nanovllm import LLM, SamplingParams
    prompts = random_prompts((13, 30, 7), seed=5)
    for policy in ("write_back", "write_through"):
        kwargs = tiny_llm_kwargs(kvcache_block_size=4, num_kvcache_blocks=64, swap_space=0.001,
                                 host_cache_policy=policy, kv_disk_path=str(tmp_path / policy))
        with LLM(qwen3_dir, **kwargs) as llm:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
            assert llm.reset_prefix_cache(), policy
            assert llm.host_tier.pool.num_free_blocks == llm.host_tier.num_blocks
            # write-through: each full block of the three sequences (15, 32 and 9 tokens) as soon as it was cached;
            # write-back: none yet (the last step's blocks reach the host at the next step, which an idle engine
            # does not take)
            assert llm.stats()["blocks_written_to_disk"] == {"write_back": 0, "write_through": 3 + 8 + 2}[policy]
