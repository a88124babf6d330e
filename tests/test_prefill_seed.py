"""The host tier's policy starts from a prefill speed measured at start-up on CUDA (nanovllm/engine/prefill_probe.py),
not from the prior; on the CPU nothing is measured and the priors stay. The disk decision at the first admission
with a seeded speed: tests/test_disk_tier.py."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import close_llm, greedy, random_prompts, tiny_llm_kwargs
from nanovllm.engine.prefill_probe import PROBE_NUM_SEQS, measure_prefill_tokens_per_s
from nanovllm_offload.offload_manager import CPU_PREFILL_PRIOR, OffloadManager
from nanovllm_offload.policy import PreemptionPolicy

GPU_PRIOR = PreemptionPolicy("auto", 1).prefill_tokens_per_s


class FakeClock:
    """perf_counter for the probe: each forward advances it by its own time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_runner(clock: FakeClock, forward_seconds: list[float], num_blocks: int = 128, block_size: int = 16,
                max_num_batched_tokens: int = 16384, max_model_len: int = 4096):
    """A runner whose forwards take forward_seconds in turn (the first: a compile) and record their plans."""
    from nanovllm.engine.model_runner import ModelRunner
    runner = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=max_num_batched_tokens,
                                                    max_model_len=max_model_len),
                             block_size=block_size, kv_cache=torch.empty(num_blocks, 1), device=torch.device("cpu"),
                             rank=0, plans=[])
    runner.warmup_plan = lambda query_lens: ModelRunner.warmup_plan(runner, query_lens)

    def forward(plan):
        runner.plans.append(plan)
        clock.now += forward_seconds[len(runner.plans) - 1]
    runner.forward = forward
    return runner


def test_the_probe_times_the_second_of_two_equal_prefills():
    clock = FakeClock()
    runner = fake_runner(clock, [7.0, 0.004])  # the first forward compiles for 7 s: not timed
    assert measure_prefill_tokens_per_s(runner, clock) == pytest.approx(2048 / 0.004)
    first, second = runner.plans
    assert second is first and first.query_lens == [512] * PROBE_NUM_SEQS
    assert first.block_tables[1] == list(range(32, 64))  # each sequence in its own free blocks


@pytest.mark.parametrize("limits, query_len", [
    (dict(max_num_batched_tokens=256), 64),  # the step budget
    (dict(max_model_len=100), 100),  # a sequence is never longer than the model allows
    (dict(num_blocks=20), 80),  # 5 blocks of 16 per sequence: the cache
])
def test_the_probe_step_fits_the_config_and_the_cache(limits, query_len):
    clock = FakeClock()
    runner = fake_runner(clock, [1.0, 0.5], **limits)
    assert measure_prefill_tokens_per_s(runner, clock) == pytest.approx(PROBE_NUM_SEQS * query_len / 0.5)
    assert runner.plans[0].query_lens == [query_len] * PROBE_NUM_SEQS


def test_the_probe_measures_nothing_without_room():
    clock = FakeClock()
    runner = fake_runner(clock, [1.0, 1.0], num_blocks=3)  # not one block per sequence
    assert measure_prefill_tokens_per_s(runner, clock) is None and runner.plans == []


def test_the_probe_runs_the_real_forward_and_leaves_later_steps_unchanged(qwen3_dir):
    """On a real runner (the CPU, called by hand: the engine calls it on CUDA only), before any request as at
    start-up: the probe's prefills write only free blocks, so the tokens generated afterwards are the same."""
    from nanovllm import LLM
    prompts = random_prompts([30, 45, 12], seed=5)
    results = []
    for probe in (False, True):
        llm = LLM(qwen3_dir, **tiny_llm_kwargs(max_num_batched_tokens=64))
        try:
            if probe:
                assert measure_prefill_tokens_per_s(llm.runner) > 0
            results.append([o["token_ids"] for o in llm.generate(prompts, greedy(6), use_tqdm=False)])
        finally:
            close_llm(llm)
    assert results[0] == results[1]


def test_a_seeded_speed_replaces_the_prior_and_none_keeps_it():
    tier = OffloadManager(4, 16, PreemptionPolicy("auto", 1024), prefix_cache=True)
    tier.seed_prefill_speed(None)
    assert tier.policy.prefill_tokens_per_s == GPU_PRIOR
    tier.seed_prefill_speed(0.0)  # no measurement either
    assert tier.policy.prefill_tokens_per_s == GPU_PRIOR
    tier.seed_prefill_speed(345e3)
    assert tier.policy.prefill_tokens_per_s == tier.stats()["prefill_tokens_per_s"] == 345e3


def test_the_engine_seeds_the_policy_with_rank_0s_measurement(qwen3_dir, monkeypatch):
    """The runner's measurement stubbed (the CPU measures nothing): the policy starts from it, stats() shows it."""
    from nanovllm import LLM
    from nanovllm.engine.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "measure_prefill_speed", lambda self: 123456.0)
    llm = LLM(qwen3_dir, **tiny_llm_kwargs())
    try:
        assert llm.host_tier.policy.prefill_tokens_per_s == llm.stats()["prefill_tokens_per_s"] == 123456.0
    finally:
        close_llm(llm)


@pytest.mark.parametrize("disk, prior", [(False, GPU_PRIOR), (True, CPU_PREFILL_PRIOR)], ids=["host", "disk"])
def test_nothing_is_measured_on_the_cpu(qwen3_dir, tmp_path, disk, prior):
    from nanovllm import LLM
    kwargs = dict(kv_disk_path=str(tmp_path / "kv"), swap_space=0.05) if disk else {}
    llm = LLM(qwen3_dir, **tiny_llm_kwargs(**kwargs))
    try:
        assert llm.runner.measure_prefill_speed() is None
        assert llm.host_tier.policy.prefill_tokens_per_s == llm.stats()["prefill_tokens_per_s"] == prior
    finally:
        close_llm(llm)


def test_stats_without_a_host_tier(qwen3_dir):
    from nanovllm import LLM
    llm = LLM(qwen3_dir, **tiny_llm_kwargs(swap_space=0, preemption_mode="recompute"))
    try:
        stats = llm.stats()
        assert llm.host_tier is None and stats["num_cpu_blocks"] == stats["disk_hit_tokens"] == 0
        assert "prefill_tokens_per_s" not in stats  # no policy, no speed
    finally:
        close_llm(llm)


GPU_RUN = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from nanovllm import LLM
with LLM(sys.argv[1], device="cuda", dtype="float32", kvcache_block_size=16, max_model_len=512, max_num_seqs=8,
         swap_space=0.1) as llm:
    print(json.dumps({"seeded": llm.stats()["prefill_tokens_per_s"]}))
"""


@pytest.mark.gpu
def test_a_cuda_engine_starts_from_a_measured_prefill_speed(qwen3_dir):
    proc = subprocess.run([sys.executable, "-c", GPU_RUN, qwen3_dir], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seeded = json.loads(proc.stdout.strip().splitlines()[-1])["seeded"]
    assert seeded != GPU_PRIOR and seeded > 1e3, seeded
    assert "prefill speed measured at start-up" in proc.stderr


def test_a_few_token_step_barely_moves_the_prefill_speed():
    """A 3-token prefill in 10 ms (300 tok/s: a step's fixed cost) must not drag a measured 100k tok/s a fifth of the
    way down; a full-size step still moves it by the EMA weight."""
    policy = PreemptionPolicy("auto", 1, prefill_tokens_per_s=100e3)
    policy.observe_prefill(3, 0.01)
    assert policy.prefill_tokens_per_s == pytest.approx(100e3 - 0.2 * 3 / 1024 * (100e3 - 300))  # ~99.94k
    policy.observe_prefill(2048, 2048 / 50e3)  # 50k tok/s over a full step
    assert policy.prefill_tokens_per_s == pytest.approx(99941.6 + 0.2 * (50e3 - 99941.6), rel=1e-4)
