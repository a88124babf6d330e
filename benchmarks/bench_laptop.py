"""bench_swap.py's laptop scenarios: the workloads of an 8 GB RTX 4070 laptop user, run inside an 8 GiB budget
(gpu_memory_budget_gib) at the engine's default gpu_memory_utilization, Qwen3-1.7B shape, dummy weights.

"laptop-reasoning": 256 requests, prompts of 100-1,000 tokens, outputs of 1,000-6,000 (random.Random(2)),
ignore_eos; modes recompute, swap, auto.
"laptop-agent": 4 agent sessions x 8 turns after a 2,048-token shared system prompt; each turn appends a tool output
of 500-3,000 tokens and generates 200-800 (random.Random(3)); modes no_host_tier and host_tier (16 GiB host pool).
"laptop-agent-restart": laptop-agent split by a process restart after turn 4 (benchmarks/bench_restart.py): a
"before" process runs turns 1-4 with the disk tier and saves the histories; a fresh process per mode runs turns 5-8
from them, cold
(no disk tier: the history is recomputed) or disk (the same kv_disk_path: the engine loads or recomputes per hit).

Steps are at most 2,048 tokens (max_num_batched_tokens) and at most 256 sequences (reasoning) or 16 (agent) run at
once (max_num_seqs): on an 8 GiB card a 16,384-token profiling step and a 1,024-row sampler would take much of what
the KV could have, and the agent's longest history (26,780 tokens) must fit in the GPU's KV on its own.
"""
import os
import random
import time

from benchmarks.bench_restart import DiskDecisions, load_histories, save_histories
from nanovllm.config import head_dim_of
from nanovllm.core.memory_plan import GiB, plan_kv_blocks
from nanovllm.core.request_metrics import latency_summary
from nanovllm.utils.presets import preset_dir

_AGENT = dict(shape="qwen3-1.7b", num_seqs=4, gpu_memory_gib=8, swap_space=16, max_model_len=32768, num_turns=8,
              max_num_seqs=16, assumed_activation_peak_gib=0.25)
LAPTOP_SCENARIOS = {
    "laptop-reasoning": dict(shape="qwen3-1.7b", num_seqs=256, gpu_memory_gib=8, swap_space=16,
                             max_model_len=7168, max_num_seqs=256, assumed_activation_peak_gib=0.5),
    # 4 sessions need few rows, and a smaller sampler peak leaves the KV room for the longest history (26,780 tokens)
    "laptop-agent": _AGENT,
    "laptop-agent-restart": dict(_AGENT, restart_after_turn=4),
}
REASONING_MODES = ["recompute", "swap", "auto"]
AGENT_MODES = ["no_host_tier", "host_tier"]
RESTART_MODES = ["cold", "disk"]  # the processes after the restart; "before" runs first, whatever the modes
# --simulate has no GPU to measure: what an 8 GiB card is assumed to lose besides the weights and the activation
# peak (each scenario's assumed_activation_peak_gib: a 2,048-token step and its sampler rows with top-k/top-p);
# replace with the terms the GPU run logs at start-up, or pass --kv-gib
ASSUMED_GRAPH_POOL_GIB = 0.25
ASSUMED_NON_TORCH_GIB = 0.5  # CUDA context and kernels


def model_dir(shape: str) -> str:
    """--shape: a preset's name, or a directory with a config.json (a small model for a CPU run)."""
    return shape if os.path.isdir(shape) else preset_dir(shape)


def laptop_options(scenario: str, mode: str, args) -> dict:
    """Engine options of one mode; the budget, not a KV cap, decides the KV (unless --kv-gib). --gpu-memory-gib 0:
    the whole GPU. The restart's "before" and "disk" processes share one kv_disk_path under --restart-dir."""
    s = LAPTOP_SCENARIOS[scenario]
    budget_gib = s["gpu_memory_gib"] if args.gpu_memory_gib is None else args.gpu_memory_gib or None
    options = dict(load_format="dummy", enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype,
                   tensor_parallel_size=args.tensor_parallel_size, async_scheduling=args.async_scheduling,
                   kvcache_block_size=args.kvcache_block_size, max_model_len=s["max_model_len"],
                   max_num_batched_tokens=2048, max_num_seqs=args.max_num_seqs or s["max_num_seqs"],
                   gpu_memory_budget_gib=budget_gib)
    if args.kv_gib is not None:
        options.update(kv_cache_memory_bytes=int(args.kv_gib * GiB) // args.tensor_parallel_size)
    swap_space = s["swap_space"] if args.swap_space is None else args.swap_space
    if mode in ("recompute", "no_host_tier"):
        options.update(preemption_mode="recompute", swap_space=0, host_cache_policy="off")
    elif mode in ("host_tier", "before", "cold", "disk"):
        options.update(preemption_mode="auto", swap_space=swap_space, host_cache_policy="write_back")
    else:  # swap, auto: preemption alone, as bench_swap.py's other scenarios compare it
        options.update(preemption_mode=mode, swap_space=swap_space, host_cache_policy="off")
    if mode in ("before", "disk"):
        options.update(kv_disk_path=os.path.join(args.restart_dir, "kv"))
    return options


def reasoning_workload(num_seqs: int):
    """Prompt lengths, then output lengths, then prompt ids, all from random.Random(2)."""
    rng = random.Random(2)
    prompt_lens = [rng.randint(100, 1000) for _ in range(num_seqs)]
    output_lens = [rng.randint(1000, 6000) for _ in range(num_seqs)]
    prompts = [[rng.randint(0, 10000) for _ in range(n)] for n in prompt_lens]
    return prompts, output_lens


def agent_workload(num_sessions: int, num_turns: int = 8, token_scale: float = 1.0):
    """The shared system prompt, then per session and turn a tool output and an output length (random.Random(3)).
    token_scale multiplies every length (quick runs); at 1, the issue's workload draw for draw."""
    rng = random.Random(3)

    def scaled(num_tokens: int) -> int:
        return max(1, round(num_tokens * token_scale))

    system = [rng.randint(0, 10000) for _ in range(scaled(2048))]
    tools = [[[rng.randint(0, 10000) for _ in range(rng.randint(scaled(500), scaled(3000)))] for _ in range(num_turns)]
             for _ in range(num_sessions)]
    max_tokens = [[rng.randint(scaled(200), scaled(800)) for _ in range(num_turns)] for _ in range(num_sessions)]
    return system, tools, max_tokens


def simulated_num_gpu_blocks(scenario: str, config, block_bytes: int, args) -> int:
    """--simulate's KV: --kv-gib, or what plan_kv_blocks leaves on the budget's card with the assumed terms."""
    if args.kv_gib is not None:
        return int(args.kv_gib * GiB) // args.tensor_parallel_size // block_bytes
    if config.gpu_memory_budget_gib is None:
        raise ValueError("--simulate sizes the KV from the card's memory: pass --gpu-memory-gib N (not 0) or --kv-gib")
    quantization = getattr(config.hf_config, "quantization_config", None)
    if quantization:  # num_parameters counts bf16 bytes: a quantized shape's KV would come out gigabytes short
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"--simulate sizes the KV from bf16 weights, and this shape's weights are quantized "
                         f"({method}): pass --kv-gib with the KV its GPU run logs at start-up")
    card = int(config.gpu_memory_budget_gib * GiB)
    weights = 2 * num_parameters(config.hf_config) // config.tensor_parallel_size  # bf16
    activation_peak = int(LAPTOP_SCENARIOS[scenario]["assumed_activation_peak_gib"] * GiB)
    return plan_kv_blocks(card, config.gpu_memory_utilization, weights, activation_peak,
                          int(ASSUMED_GRAPH_POOL_GIB * GiB), int(ASSUMED_NON_TORCH_GIB * GiB), block_bytes)[0]


def num_parameters(hf) -> int:
    head_dim = head_dim_of(hf)
    h = hf.hidden_size
    attention = h * head_dim * (2 * hf.num_attention_heads + 2 * hf.num_key_value_heads)
    layer = attention + 3 * h * hf.intermediate_size + 2 * h + 2 * head_dim
    embeddings = hf.vocab_size * h * (1 if hf.tie_word_embeddings else 2)
    return hf.num_hidden_layers * layer + embeddings + h


def run_laptop(scenario: str, mode: str, num_seqs: int, args, options: dict) -> dict:
    """Runs inside bench_swap.py's subprocess: one engine, one mode, the whole workload (laptop-agent-restart: one
    side of the restart)."""
    from nanovllm import LLM, SamplingParams
    shape = args.shape or LAPTOP_SCENARIOS[scenario]["shape"]
    llm = LLM(model_dir(shape), **options)
    start_prefill_tokens_per_s = llm.stats().get("prefill_tokens_per_s")  # seeded: measured at start-up on CUDA
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    if args.warmup_tokens:  # timed prefills for the disk rule; fresh ids in every process, so that no tier holds them
        rng = random.Random()
        llm.generate([[rng.randint(0, 10000) for _ in range(args.warmup_tokens)]], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    decisions = DiskDecisions(llm, start_prefill_tokens_per_s)
    base, start = llm.stats(), time.perf_counter()
    if scenario == "laptop-reasoning":
        prompts, output_lens = reasoning_workload(num_seqs)
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in output_lens]
        metrics = [o["metrics"] for o in llm.generate(prompts, params, use_tqdm=not args.no_tqdm)]
        agent = dict(agent_waits=[], output_tokens=sum(output_lens), turns=[])
    else:
        turn_ids, histories = agent_turns(scenario, mode, num_seqs, args)
        metrics, agent, histories = _run_agent(llm, num_seqs, args, turn_ids, histories)
    seconds = time.perf_counter() - start
    stats, memory = stats_since(base, llm.stats()), llm.memory_breakdown
    llm.close()  # with a disk tier: waits for every write
    disk = decisions.summary()
    if mode == "before":
        save_histories(args.restart_dir, histories, restart_workload(num_seqs, args))
    return dict(mode=mode, shape=shape, seconds=seconds, stats=stats, memory=memory, latency=latency_summary(metrics),
                timeline=[], disk=disk, **agent)


def stats_since(base: dict, now: dict) -> dict:
    """llm.stats() counters since `base`; sizes (num_*) and speeds (*_per_s) as they are now."""
    return {k: v - base[k] if isinstance(v, (int, float)) and k in base and not k.startswith("num_")
            and not k.endswith("_per_s") else v for k, v in now.items()}


def agent_turns(scenario: str, mode: str, num_sessions: int, args) -> tuple[range, list[list[int]] | None]:
    """The turns this process runs and the histories it starts from (None: the system prompt). laptop-agent-restart:
    "before" runs the turns up to the restart; the others run the rest from the histories "before" saved."""
    s = LAPTOP_SCENARIOS[scenario]
    split = s.get("restart_after_turn")
    if split is None:
        return range(s["num_turns"]), None
    if mode == "before":
        return range(split), None
    return range(split, s["num_turns"]), load_histories(args.restart_dir, restart_workload(num_sessions, args))


def restart_workload(num_sessions: int, args) -> dict:
    """What the saved histories must have been made with for the turns after the restart to continue them."""
    return dict(num_sessions=num_sessions, token_scale=args.token_scale,
                restart_after_turn=LAPTOP_SCENARIOS["laptop-agent-restart"]["restart_after_turn"])


def _run_agent(llm, num_sessions: int, args, turn_ids: range, histories: list[list[int]] | None):
    """The sessions' turns turn_ids, all sessions' turn t in one generate call, from `histories` (None: the system
    prompt). Returns the metrics dicts; the seconds from first scheduled to first token of every turn but the
    first, the output tokens and per turn its seconds and prompt tokens computed; and the final histories."""
    from nanovllm import SamplingParams
    system, tools, max_tokens = agent_workload(num_sessions, LAPTOP_SCENARIOS["laptop-agent"]["num_turns"],
                                               args.token_scale)
    histories = histories or [list(system) for _ in range(num_sessions)]
    start_history_tokens = sum(map(len, histories))
    metrics, waits, turns, output_tokens = [], [], [], 0
    for t in turn_ids:
        prompts = [h + tools[c][t] for c, h in enumerate(histories)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m[t]) for m in max_tokens]
        computed, start = llm.stats()["prefill_tokens"], time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
        turns.append(dict(turn=t + 1, seconds=time.perf_counter() - start, prompt_tokens=sum(map(len, prompts)),
                          computed=llm.stats()["prefill_tokens"] - computed))
        histories = [p + o["token_ids"] for p, o in zip(prompts, outputs)]
        metrics += [o["metrics"] for o in outputs]
        output_tokens += sum(p.max_tokens for p in params)
        if t > 0:
            waits += [o["metrics"]["first_token_time"] - o["metrics"]["first_scheduled_time"] for o in outputs]
        print(f"laptop-agent: turn {t + 1} history {max(map(len, histories))} tokens, {turns[-1]['seconds']:.2f} s, "
              f"{turns[-1]['computed']} prompt tokens computed", flush=True)
    return metrics, dict(agent_waits=waits, output_tokens=output_tokens, turns=turns,
                         start_history_tokens=start_history_tokens,
                         end_history_tokens=sum(map(len, histories))), histories


def print_laptop_table(scenario: str, results: list[dict]):
    import statistics
    print(f"\n## {scenario}: {LAPTOP_SCENARIOS[scenario]}")
    for r in results[:1]:
        if r.get("memory"):
            m = {k: v / GiB for k, v in r["memory"].items() if k != "num_blocks"}
            print("memory GiB: " + ", ".join(f"{k} {v:.2f}" for k, v in m.items()))
    head = ("mode", "GPU blocks", "out tok", "seconds", "tok/s", "steps", "decode rows/step", "preempt swap/recomp",
            "recomputed", "prompt tok computed", "host hits", "TTFT p50/p99 s", "ITL p50/p99 ms", "exposed copy s",
            "sched->1st tok p50 s (turns 2-8)")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in results:
        s, lat = r["stats"], r["latency"]
        wait = f"{statistics.median(r['agent_waits']):.3f}" if r["agent_waits"] else "-"
        print(f"| {r['mode']} | {s['num_gpu_blocks']} | {r['output_tokens']} | {r['seconds']:.1f} | "
              f"{r['output_tokens'] / r['seconds']:.0f} | {s['steps']} | "
              f"{s['decode_tokens'] / max(s['steps'], 1):.1f} | {s['preemptions_swap']}/{s['preemptions_recompute']} | "
              f"{s['recomputed_tokens']} | {s['prefill_tokens']} | {s['host_prefix_hit_tokens']} | "
              f"{lat['ttft_p50']:.2f}/{lat['ttft_p99']:.2f} | {lat['itl_p50'] * 1e3:.1f}/{lat['itl_p99'] * 1e3:.1f} | "
              f"{s['swap_exposed_seconds']:.2f} of {s['swap_seconds']:.2f} | {wait} |")
