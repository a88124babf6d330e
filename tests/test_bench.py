"""bench.py's own arithmetic on a tiny model on CPU: the KV the decode steps read and the bound it puts on them."""
import os
import sys

import pytest

from conftest import close_llm, random_prompts, tiny_llm_kwargs

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402


@pytest.mark.slow
def test_decode_traffic_counts_every_context_token_of_every_decode_step(qwen3_dir, monkeypatch):
    """Prompts of 12, 30 and 7 tokens, 9, 5 and 16 new tokens, all prefilled in the first step: a sequence with a
    P-token prompt and N new tokens has N - 1 decode steps, reading P + 1, ..., P + N - 1 tokens of context."""
    lengths, new_tokens = [12, 30, 7], [9, 5, 16]
    llm = LLM(qwen3_dir, **tiny_llm_kwargs())
    try:
        # HostTimer wraps it: undo after
        monkeypatch.setattr(bench.engine_core, "make_plan", bench.engine_core.make_plan)
        timer = bench.HostTimer(llm)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in new_tokens]
        llm.generate(random_prompts(lengths), params, use_tqdm=False)
        assert timer.decode_context_tokens == sum((n - 1) * p + n * (n - 1) // 2 for p, n in zip(lengths, new_tokens))
        assert timer.num_steps == max(new_tokens) - 1
        line = bench.decode_traffic_bound(llm, timer)
        # tiny qwen3 in float32: 2 layers x K,V x 2 kv heads x 32 dims x 4 bytes a token
        kv_bytes = timer.decode_context_tokens * 2 * 2 * 2 * 32 * 4
        assert f"read {kv_bytes / 1e12:.2f} TB of KV and {timer.num_steps} x " in line
        assert "FASTER THAN THE BOUND" not in line  # a tiny model on CPU is far from its bandwidth bound
        timer.decode_wall_seconds = 1e-9  # a "run" faster than its reads allow is flagged
        assert "FASTER THAN THE BOUND ALLOWS" in bench.decode_traffic_bound(llm, timer)
    finally:
        close_llm(llm)


def test_a_failed_variant_makes_the_comparison_fail(monkeypatch, capsys):
    """A variant whose process fails must not leave the side-by-side run looking fine (exit status 0)."""
    import subprocess
    monkeypatch.setattr(sys, "argv", ["bench.py", "--shape", "no-such-shape"])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "ValueError: shape"))
    assert bench.run_variants(["", "NANOVLLM_DECODE_TILE=64,32,2,4"], 1) == 1
    ok = subprocess.CompletedProcess([], 0, "Throughput: 100 tok/s", "")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: ok)
    assert bench.run_variants(["", "NANOVLLM_DECODE_TILE=64,32,2,4"], 1) == 0


@pytest.mark.slow  # the torch profiler
def test_profile_step_runs_decode_and_mixed_steps(qwen3_dir, capsys):
    """bench.py --profile-decode 3:16 and --profile-mixed 2:8x2 on CPU: the steps run through the sampler (it was
    handed the forward's (logits, prompt logprobs) pair and failed) and the line with the timing is printed."""
    llm = LLM(qwen3_dir, **tiny_llm_kwargs())
    try:
        bench.profile_step(llm.runner, 3, context_len=16, num_iters=2)
        bench.profile_step(llm.runner, 2, prefill_len=8, context_len=16, num_iters=2, num_prompts=2)
    finally:
        close_llm(llm)
    out = capsys.readouterr().out
    assert "step: 3 decode rows (context 16) + 1 x 0-token prompts: " in out
    assert "step: 2 decode rows (context 16) + 2 x 8-token prompts: " in out
    assert out.count("ms per step back to back") == 2
