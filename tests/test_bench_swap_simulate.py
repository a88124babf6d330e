"""bench_swap.py --simulate: the scenarios' scheduling on CPU, with the engine's own scheduler (no model)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_swap  # noqa: E402


def simulated(scenario: str, mode: str, scale: float, block_size: int = 64) -> dict:
    args = bench_swap.parse_args(["--scenario", scenario, "--simulate", "--kvcache-block-size", str(block_size)])
    num_seqs = max(1, round(bench_swap.SCENARIOS[scenario]["num_seqs"] * scale))
    return bench_swap.simulate(scenario, mode, num_seqs, args)


def test_rtx4070_swap_recomputes_nothing_and_recompute_does():
    swap, recompute = simulated("rtx4070", "swap", 1.0), simulated("rtx4070", "recompute", 1.0)
    assert swap["num_gpu_blocks"] == recompute["num_gpu_blocks"] == (4 << 30) // (64 * 28 * 2 * 8 * 128 * 2)
    assert swap["preemptions_swap"] > 50 and swap["recomputed_tokens"] == 0 and swap["preemptions_recompute"] == 0
    assert recompute["preemptions_recompute"] > 50 and recompute["recomputed_tokens"] > 0
    from bench import seed_workload
    prompts, _ = seed_workload(256)
    assert swap["prefill_tokens"] == sum(map(len, prompts))  # swap computes each prompt token once, nothing else


def test_chat_host_tier_serves_history_from_the_host():
    no_tier, tier = simulated("chat", "no_host_tier", 1.0), simulated("chat", "host_tier", 1.0)
    assert tier["host_prefix_hit_tokens"] > 0 and no_tier["host_prefix_hit_tokens"] == 0
    assert tier["prefill_tokens"] < no_tier["prefill_tokens"]
    # every request after the first finds the 2,048-token system prompt cached (turn 1's same-step sharing is
    # checked exactly in test_scheduler.py and test_hf_parity.py)
    assert no_tier["prefix_cache_hit_tokens"] >= (128 - 1) * 2048


def test_tensor_parallel_simulation_sizes_one_rank_as_the_engine_does():
    """Each rank gets 1/N of the KV budget and holds 1/N of the KV heads: the same number of blocks."""
    args = bench_swap.parse_args(["--scenario", "rtx4070", "--simulate", "-tp", "2"])
    tp2 = bench_swap.simulate("rtx4070", "swap", 8, args)
    assert tp2["num_gpu_blocks"] == simulated("rtx4070", "swap", 8 / 256)["num_gpu_blocks"] == 585


def test_command_line_details_reach_the_runs():
    args = bench_swap.parse_args(["--scenario", "rtx4070", "--swap-space", "0"])
    assert bench_swap.engine_options("rtx4070", "swap", args)["swap_space"] == 0  # 0 is not "the default"
    cmd = ["python", "bench_swap.py", "--run-mode", "rtx4070", "swap", "/tmp/x", "--scenario", "rtx4070", "-tp", "2",
           "--modes", "swap", "auto", "--enforce-eager"]
    assert bench_swap._strip_scenario(cmd) == ["python", "bench_swap.py", "--run-mode", "rtx4070", "swap", "/tmp/x",
                                               "-tp", "2", "--enforce-eager"]


def test_the_restart_scenario_is_refused_by_simulate(capsys):
    with pytest.raises(SystemExit):
        bench_swap.parse_args(["--scenario", "laptop-agent", "laptop-agent-restart", "--simulate"])
    assert "--simulate cannot run laptop-agent-restart" in capsys.readouterr().err


def test_laptop_options_are_the_runs_and_the_simulations():
    """One source of a laptop mode's options (the GPU run, --simulate and the restart's processes read it)."""
    args = bench_swap.parse_args(["--scenario", "laptop-agent-restart", "--engine-options", '{"max_num_seqs": 4}'])
    args.restart_dir = "/tmp/restart"
    cold, disk = (bench_swap.engine_options("laptop-agent-restart", mode, args) for mode in ("cold", "disk"))
    assert disk == dict(cold, kv_disk_path="/tmp/restart/kv")
    assert cold["load_format"] == "dummy" and cold["gpu_memory_budget_gib"] == 8 and cold["max_num_seqs"] == 4
    assert cold["host_cache_policy"] == "write_back" and "kv_disk_path" not in cold
    whole_gpu = bench_swap.parse_args(["--scenario", "laptop-agent", "--gpu-memory-gib", "0"])
    assert bench_swap.engine_options("laptop-agent", "host_tier", whole_gpu)["gpu_memory_budget_gib"] is None


def test_the_agent_workload_at_token_scale_1_is_the_issues():
    import random
    rng = random.Random(3)  # the issue's generator, in its order
    system = [rng.randint(0, 10000) for _ in range(2048)]
    tools = [[[rng.randint(0, 10000) for _ in range(rng.randint(500, 3000))] for _ in range(8)] for _ in range(4)]
    max_tokens = [[rng.randint(200, 800) for _ in range(8)] for _ in range(4)]
    assert bench_swap.agent_workload(4, 8) == (system, tools, max_tokens)
    short_system, short_tools, short_max_tokens = bench_swap.agent_workload(2, 8, token_scale=0.05)
    assert len(short_system) == 102 and all(25 <= len(t) <= 150 for s in short_tools for t in s)
    assert all(10 <= m <= 40 for s in short_max_tokens for m in s)


def test_simulate_refuses_to_size_a_quantized_shapes_kv_from_bf16_weights():
    """--simulate counts bf16 weights; for a quantized preset that would leave the 4B FP8 no KV at all (a "no
    progress" error that blamed the scheduler), so it asks for --kv-gib, and runs with it."""
    base = ["--scenario", "laptop-reasoning", "--simulate", "--shape", "qwen3-4b-fp8", "--kv-cache-dtype", "fp8"]
    with pytest.raises(ValueError, match=r"quantized \(fp8\): pass --kv-gib"):
        bench_swap.simulate("laptop-reasoning", "swap", 4, bench_swap.parse_args(base))
    run = bench_swap.simulate("laptop-reasoning", "swap", 4, bench_swap.parse_args(base + ["--kv-gib", "3"]))
    assert run["num_gpu_blocks"] > 0 and run["recomputed_tokens"] == 0
