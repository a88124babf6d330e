"""Swap vs recompute under KV pressure, with dummy weights. Each mode runs in its own process
(nanovllm.utils.fresh_process: it does not pay the engine's imports again).

    python bench_swap.py --scenario rtx4070              # Qwen3-0.6B shape, 256 seqs, 4 GiB of GPU KV
    python bench_swap.py --scenario h800                 # Qwen3-8B shape, 1024 seqs, 55 GiB of GPU KV
    python bench_swap.py --scenario rtx4070 --scale 0.25 --plot
    python bench_swap.py --scenario chat                 # multi-turn chat: the host tier as a prefix cache
    python bench_swap.py --scenario rtx4070 chat --simulate   # the scheduler alone, on CPU, in seconds
    python bench_swap.py --scenario laptop-reasoning laptop-agent   # in an 8 GiB budget (benchmarks/bench_laptop.py)
    python bench_swap.py --scenario laptop-agent-restart             # the disk tier across a process restart

Modes: unpressured (no KV cap), recompute, swap, auto (all three capped). The workload is nano-vllm's bench.py:
random.seed(0), prompt and output lengths uniform in [100, 1024], prompt ids uniform in [0, 10000]. The host prefix
cache is off in these four modes, so that they compare preemption alone.
"chat": 128 conversations x 4 turns sharing a 2048-token system prompt, Qwen3-8B shape, 20 GiB of GPU KV; modes
no_host_tier (recompute, no host pool) and host_tier (64 GiB host pool: prefix cache + swap).
"laptop-reasoning", "laptop-agent": an 8 GB laptop's workloads inside gpu_memory_budget_gib=8
(benchmarks/bench_laptop.py).
"laptop-agent-restart": laptop-agent split by a process restart after turn 4; modes cold and disk
(benchmarks/bench_restart.py).
--gpu-memory-gib N runs any scenario as if the GPU had N GiB (gpu_memory_budget_gib).
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

from benchmarks.bench_laptop import (AGENT_MODES, LAPTOP_SCENARIOS, REASONING_MODES, RESTART_MODES, agent_workload,
                          laptop_options, model_dir, print_laptop_table, reasoning_workload, run_laptop,
                          simulated_num_gpu_blocks, stats_since)
from benchmarks.bench_restart import print_restart_table, run_restart
from benchmarks.bench_timeline import Timeline, plot
from nanovllm.config import KV_CACHE_DTYPES
from nanovllm.core.request_metrics import latency_summary
from nanovllm.utils.fresh_process import start_fresh_process
from nanovllm.utils.presets import preset_dir

GiB = 1 << 30
SCENARIOS = {
    "rtx4070": dict(shape="qwen3-0.6b", num_seqs=256, kv_gib=4, swap_space=16),
    "h800": dict(shape="qwen3-8b", num_seqs=1024, kv_gib=55, swap_space=64),
    "chat": dict(shape="qwen3-8b", num_seqs=128, kv_gib=20, swap_space=64, num_turns=4),
    **LAPTOP_SCENARIOS,
}
MODES = ["unpressured", "recompute", "swap", "auto"]
CHAT_MODES = ["no_host_tier", "host_tier"]


def scenario_modes(scenario: str) -> list[str]:
    return {"chat": CHAT_MODES, "laptop-agent": AGENT_MODES, "laptop-reasoning": REASONING_MODES,
            "laptop-agent-restart": RESTART_MODES}.get(scenario, MODES)


def chat_workload(num_convs: int, num_turns: int = 4):
    """128 conversations x 4 turns sharing a 2048-token system prompt (the issue's generator, in its order)."""
    rng = random.Random(1)
    system = [rng.randint(0, 10000) for _ in range(2048)]
    users = [[[rng.randint(0, 10000) for _ in range(rng.randint(64, 512))] for _ in range(num_turns)]
             for _ in range(num_convs)]
    max_tokens = [[rng.randint(64, 512) for _ in range(num_turns)] for _ in range(num_convs)]
    return system, users, max_tokens


def engine_options(scenario: str, mode: str, args) -> dict:
    """The LLM options of one mode of a scenario (the GPU runs and --simulate share them), --engine-options last."""
    options = laptop_options(scenario, mode, args) if scenario in LAPTOP_SCENARIOS else _options(scenario, mode, args)
    return {**options, **args.engine_options}


def _options(scenario: str, mode: str, args) -> dict:
    s = SCENARIOS[scenario]
    swap_space = s["swap_space"] if args.swap_space is None else args.swap_space  # 0 too
    options = dict(load_format="dummy", max_model_len=8192 if scenario == "chat" else 4096,
                   gpu_memory_budget_gib=args.gpu_memory_gib or None,
                   max_num_seqs=args.max_num_seqs or 1024, enforce_eager=args.enforce_eager,
                   tensor_parallel_size=args.tensor_parallel_size, async_scheduling=args.async_scheduling,
                   kvcache_block_size=args.kvcache_block_size, kv_cache_dtype=args.kv_cache_dtype)
    if mode != "unpressured":
        options.update(kv_cache_memory_bytes=int(s["kv_gib"] * GiB) // args.tensor_parallel_size)
    if mode in ("unpressured", "recompute", "no_host_tier"):
        options.update(preemption_mode="recompute", swap_space=0, host_cache_policy="off")
    elif mode == "host_tier":
        options.update(preemption_mode="auto", swap_space=swap_space, host_cache_policy="write_back")
    else:  # swap, auto
        options.update(preemption_mode=mode, swap_space=swap_space, host_cache_policy="off")
    return options


def run_chat(mode: str, num_convs: int, args) -> dict:
    from nanovllm import LLM, SamplingParams
    s = SCENARIOS["chat"]
    llm = LLM(preset_dir(s["shape"]), **engine_options("chat", mode, args))
    system, users, max_tokens = chat_workload(num_convs, s["num_turns"])
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    histories = [list(system) for _ in range(num_convs)]
    turns, total_tokens, start = [], 0, time.perf_counter()
    keys = ("prefill_tokens", "prefix_cache_hit_tokens", "host_prefix_hit_tokens", "preemptions")
    for t in range(s["num_turns"]):
        before, turn_start = llm.stats(), time.perf_counter()
        prompts = [h + users[c][t] for c, h in enumerate(histories)]
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=max_tokens[c][t])
                  for c in range(num_convs)]
        outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
        histories = [p + o["token_ids"] for p, o in zip(prompts, outputs)]
        after = llm.stats()
        turns.append(dict(turn=t + 1, seconds=time.perf_counter() - turn_start,
                          prompt_tokens=sum(map(len, prompts)), output_tokens=sum(p.max_tokens for p in params),
                          **{k: after[k] - before[k] for k in keys}))
        total_tokens += turns[-1]["output_tokens"]
        print(f"chat/{mode}: {turns[-1]}", flush=True)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    llm.close()
    return dict(mode=mode, output_tokens=total_tokens, seconds=seconds, stats=stats, turns=turns, timeline=[])


def print_chat_table(results: list[dict]):
    print(f"\n## chat: {SCENARIOS['chat']}")
    print("| mode | turn | seconds | prompt tok | computed | GPU cache | host tier | preemptions |\n|" + "---|" * 8)
    for r in results:
        for t in r["turns"]:
            print(f"| {r['mode']} | {t['turn']} | {t['seconds']:.2f} | {t['prompt_tokens']} | {t['prefill_tokens']} | "
                  f"{t['prefix_cache_hit_tokens']} | {t['host_prefix_hit_tokens']} | {t['preemptions']} |")
    print("\n| mode | total s | output tok/s | prompt tokens computed | host hit tokens | swap GB |\n|" + "---|" * 6)
    for r in results:
        s = r["stats"]
        print(f"| {r['mode']} | {r['seconds']:.2f} | {r['output_tokens'] / r['seconds']:.0f} | "
              f"{sum(t['prefill_tokens'] for t in r['turns'])} | {s['host_prefix_hit_tokens']} | "
              f"{(s['bytes_swapped_out'] + s['bytes_swapped_in']) / 1e9:.1f} |")


def run_mode(scenario: str, mode: str, num_seqs: int, args) -> dict:
    """Runs inside the mode's process: one engine, one mode, the whole workload."""
    from bench import seed_workload
    from nanovllm import LLM, SamplingParams
    s = SCENARIOS[scenario]
    llm = LLM(preset_dir(s["shape"]), **engine_options(scenario, mode, args))
    prompts, params = seed_workload(num_seqs)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    base = llm.stats()
    timeline = Timeline(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_tqdm)
    seconds = time.perf_counter() - start
    stats = stats_since(base, llm.stats())
    llm.close()
    return dict(mode=mode, output_tokens=sum(p.max_tokens for p in params), seconds=seconds, stats=stats,
                timeline=timeline.points, latency=latency_summary([o["metrics"] for o in outputs]))


def simulate(scenario: str, mode: str, num_seqs: int, args) -> dict:
    """--simulate: the scenario's scheduling without a model or a GPU. The engine's own Scheduler, BlockManager and
    HostBlockPool run the workload with random sampled tokens, so steps, batch sizes, preemptions and prompt tokens
    computed are what a GPU run of the mode decides, as long as the decisions do not depend on measured speeds:
    "auto" is simulated as "swap" (what it chose in every H200 run so far), and the asynchronous loop's one-step lag
    is not modelled. "unpressured" is skipped: its KV size comes from the GPU's memory."""
    from nanovllm.config import Config, budget_bytes, small_card_batch_limits
    from nanovllm.engine.scheduler import Scheduler
    from nanovllm.core.sequence import Sequence
    from nanovllm_offload.host_memory import num_host_blocks_for
    from nanovllm_offload.offload_manager import OffloadManager
    from nanovllm_offload.policy import PreemptionPolicy
    from nanovllm_offload.transfer_report import TransferReport
    options = engine_options(scenario, mode, args)
    # the batch limits a budget under 70 GiB gives the GPU run (without one: the GPU machines, all larger)
    options.update(small_card_batch_limits(options, budget_bytes(options.get("gpu_memory_budget_gib"))))
    config = Config(model_dir(args.shape or SCENARIOS[scenario]["shape"]), **options)
    hf, block_size = config.hf_config, config.kvcache_block_size
    head_dim = config.head_dim
    num_kv_heads = config.num_kv_heads // config.tensor_parallel_size  # one rank's, as its budget is
    import torch
    from nanovllm.layers.kv_layout import KVLayout
    block_bytes = KVLayout(hf.num_hidden_layers, block_size, num_kv_heads, head_dim, torch.bfloat16,  # as on GPU
                           config.kv_cache_dtype).block_bytes
    num_cpu_blocks = num_host_blocks_for(config, block_bytes)  # sized as the engine sizes it
    offload = None
    if num_cpu_blocks is not None:
        policy = PreemptionPolicy("swap" if config.preemption_mode == "auto" else config.preemption_mode, block_bytes)
        offload = OffloadManager(num_cpu_blocks, block_size, policy, config.host_prefix_cache)
    num_gpu_blocks = (simulated_num_gpu_blocks(scenario, config, block_bytes, args) if scenario in LAPTOP_SCENARIOS
                      else config.kv_cache_memory_bytes // block_bytes)
    scheduler = Scheduler.from_config(config, num_gpu_blocks, offload, set())
    rng = random.Random(0)
    counts = dict(steps=0, decode_steps=0, batch_rows=0)

    def run(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
        seqs = [Sequence(p, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m), block_size)
                for p, m in zip(prompts, max_tokens)]
        for seq in seqs:
            scheduler.add(seq)
        while not scheduler.is_finished():
            out = scheduler.schedule()
            _check_progress(counts, out.is_empty,
                            f"{scenario}/{mode} ({scheduler.block_manager.num_blocks} GPU blocks)")
            counts["steps"] += 1
            counts["decode_steps"] += out.is_decode_only
            counts["batch_rows"] += len(out.seqs)
            scheduler.postprocess(out, [rng.randint(0, 10000) for sample in out.samples if sample])
            if offload is not None:  # the step's copies have landed by its end
                offload.complete(TransferReport(out.transfer_ids))
        return [seq.token_ids for seq in seqs]

    from nanovllm import SamplingParams
    if scenario == "laptop-reasoning":
        run(*reasoning_workload(num_seqs))
    elif scenario in ("chat", "laptop-agent"):
        num_turns = SCENARIOS[scenario]["num_turns"]
        system, users, max_tokens = (chat_workload(num_seqs, num_turns) if scenario == "chat"
                                     else agent_workload(num_seqs, num_turns, args.token_scale))
        histories = [list(system) for _ in range(num_seqs)]
        for t in range(num_turns):
            histories = run([h + users[c][t] for c, h in enumerate(histories)], [m[t] for m in max_tokens])
    else:
        from bench import seed_workload
        prompts, params = seed_workload(num_seqs)
        run(prompts, [p.max_tokens for p in params])
    # the simulation's own step count (every schedule() call) over the scheduler's (steps that computed tokens)
    return dict(mode=mode, block_size=block_size, num_gpu_blocks=scheduler.block_manager.num_blocks,
                **{**scheduler.stats.as_dict(), **counts})


def _check_progress(counts: dict, is_empty: bool, what: str):
    """Two empty steps in a row: stuck (a sequence longer than the whole GPU KV); the engine raises too."""
    counts["empty"] = counts.get("empty", 0) + 1 if is_empty else 0
    if counts["empty"] > 1:
        raise RuntimeError(f"{what}: no progress")


def print_simulation(scenario: str, results: list[dict], shape: str | None):
    described = dict(SCENARIOS[scenario], **({"shape": shape} if shape else {}))  # --shape named in the heading
    print(f"\n## {scenario} (simulated scheduling, no model): {described}")
    head = ("mode", "block", "GPU blocks", "steps", "decode steps", "avg batch", "preempt swap/recomp", "recomputed",
            "prompt tok computed", "GPU hits", "host hits")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in results:
        print(f"| {r['mode']} | {r['block_size']} | {r['num_gpu_blocks']} | {r['steps']} | {r['decode_steps']} | "
              f"{r['batch_rows'] / max(r['steps'], 1):.1f} | {r['preemptions_swap']}/{r['preemptions_recompute']} | "
              f"{r['recomputed_tokens']} | {r['prefill_tokens']} | {r['prefix_cache_hit_tokens']} | "
              f"{r['host_prefix_hit_tokens']} |")


def print_table(scenario: str, results: list[dict]):
    print(f"\n## {scenario}: {SCENARIOS[scenario]}")
    head = ("mode", "out tok", "seconds", "tok/s", "preempt swap/recomp", "recomputed", "GB swapped", "copy GB/s",
            "exposed s", "TTFT p50/p99 s", "ITL p50/p99 ms")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in results:
        s = r["stats"]
        swapped = (s["bytes_swapped_out"] + s["bytes_swapped_in"]) / 1e9
        lat = r["latency"]
        copy_bw = swapped / s["swap_seconds"] if s["swap_seconds"] else 0.0
        print(f"| {r['mode']} | {r['output_tokens']} | {r['seconds']:.2f} | {r['output_tokens'] / r['seconds']:.0f} | "
              f"{s['preemptions_swap']}/{s['preemptions_recompute']} | {s['recomputed_tokens']} | {swapped:.1f} | "
              f"{copy_bw:.1f} | {s['swap_exposed_seconds']:.3f} (of {s['swap_seconds']:.3f}) | "
              f"{lat['ttft_p50']:.2f}/{lat['ttft_p99']:.2f} | {lat['itl_p50'] * 1e3:.1f}/{lat['itl_p99'] * 1e3:.1f} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="+", default=["rtx4070"], choices=sorted(SCENARIOS))
    parser.add_argument("--modes", nargs="+", default=None,
                        choices=list(dict.fromkeys(MODES + CHAT_MODES + REASONING_MODES + AGENT_MODES + RESTART_MODES)),
                        help="default: all modes of the scenario")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply num-seqs (quick runs)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="default 1,024, vLLM 0.26's default on a GPU of 70 GB or more, under which its reference "
                             "numbers were measured (the engine's own default is nano-vllm's 512); laptop: 256")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="run as if the GPU had this many GiB (gpu_memory_budget_gib; laptop scenarios: 8, and 0 "
                             "for the whole GPU)")
    parser.add_argument("--shape", default=None, help="laptop scenarios: another preset (default: qwen3-1.7b) or a "
                                                      "directory with a config.json")
    parser.add_argument("--token-scale", type=float, default=1.0,
                        help="laptop-agent(-restart): multiply every prompt and output length (quick runs)")
    parser.add_argument("--warmup-tokens", type=int, default=0,
                        help="laptop scenarios: also warm up on a prompt of this many fresh tokens (e.g. 8192), so "
                             "that the engine has timed prefills before the workload (the disk rule reads them)")
    parser.add_argument("--engine-options", type=json.loads, default={},
                        help='LLM options over the scenario\'s, as JSON: \'{"num_kvcache_blocks": 512}\'')
    parser.add_argument("--kv-gib", type=float, default=None,
                        help="laptop scenarios: cap the KV at this many GiB instead of sizing it from the budget "
                             "(with --simulate: instead of the assumed terms in benchmarks/bench_laptop.py)")
    parser.add_argument("--swap-space", type=float, default=None, help="GiB; default per scenario")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kvcache-block-size", type=int, default=None, help="default: the engine's (64)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the KV cache's dtype on the GPU and in the host tier (kv_cache_memory_bytes stays the "
                             "scenario's, so FP8 gets about twice the blocks)")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule step N+1 while step N runs (default: on at TP 1)")
    parser.add_argument("--plot", action="store_true", help="write bench_swap_<scenario>.png (needs matplotlib)")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--save-timeline", action="store_true", help="write each mode's per-step timeline JSON")
    parser.add_argument("--no-tqdm", action="store_true")
    parser.add_argument("--simulate", action="store_true",
                        help="no model, no GPU: run only the scheduler on the workload and print what it decides")
    parser.add_argument("--keep-page-cache", action="store_true",
                        help="laptop-agent-restart: read the disk tier's files from the page cache if they are there "
                             "(default: dropped before the disk mode, so its reads come from the device)")
    parser.add_argument("--keep-restart-dir", action="store_true",
                        help="laptop-agent-restart: keep the KV directory and histories.json made under --out-dir")
    parser.add_argument("--run-mode", nargs=3, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--restart-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.simulate and "laptop-agent-restart" in args.scenario:
        parser.error("--simulate cannot run laptop-agent-restart: whether a disk hit is loaded depends on the disk's "
                     "and the prefill's measured speeds, which the scheduler alone does not have; simulate "
                     "laptop-agent for the workload's scheduling")
    return args


def main():
    args = parse_args()
    if args.run_mode:
        return run_in_child(args)
    num_failed = 0
    for scenario in args.scenario:
        modes_here = scenario_modes(scenario)
        modes = [m for m in (args.modes or modes_here) if m in modes_here]
        if args.simulate:
            results = [simulate(scenario, m, num_seqs_of(scenario, args), args) for m in modes if m != "unpressured"]
            print_simulation(scenario, results, args.shape)
        elif scenario == "laptop-agent-restart":
            results = run_restart(modes, args, lambda *run: run_child(*run, args=args))
            num_failed += len(modes) + 1 - len(results)  # "before" too
            print_restart_table(SCENARIOS[scenario], results)
        else:
            results = [r for r in (run_child(scenario, mode, args=args) for mode in modes) if r is not None]
            num_failed += len(modes) - len(results)
            print_results(scenario, results, args)
    return 1 if num_failed else 0


def num_seqs_of(scenario: str, args) -> int:
    return max(1, round(SCENARIOS[scenario]["num_seqs"] * args.scale))


def run_in_child(args):
    """--run-mode SCENARIO MODE PATH: one engine runs one mode and writes its result to PATH."""
    scenario, mode, path = args.run_mode
    num_seqs = num_seqs_of(scenario, args)
    if scenario in LAPTOP_SCENARIOS:
        run = run_laptop(scenario, mode, num_seqs, args, engine_options(scenario, mode, args))
    else:
        run = run_chat(mode, num_seqs, args) if scenario == "chat" else run_mode(scenario, mode, num_seqs, args)
    with open(path, "w") as f:
        json.dump(run, f)


def _run_mode_process(argv: list[str]):
    run_in_child(parse_args(argv))


def run_child(scenario: str, mode: str, extra_argv=(), *, args) -> dict | None:
    """One mode in a process of its own (--run-mode, this command's other options and extra_argv): its result, or
    None when it failed. Its row is printed as soon as it finishes."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    argv = ["--run-mode", scenario, mode, path] + [a for a in sys.argv[1:] if a != "--plot"]
    try:
        proc = start_fresh_process(_run_mode_process, (_strip_scenario(argv) + list(extra_argv),))
        proc.join()
        if proc.exitcode:
            print(f"{scenario}/{mode} failed with exit code {proc.exitcode}")
            return None
        with open(path) as f:
            r = json.load(f)
    finally:
        os.unlink(path)
    if args.save_timeline:
        with open(os.path.join(args.out_dir, f"timeline_{scenario}_{mode}.json"), "w") as f:
            json.dump(r["timeline"], f)
    print(f"{scenario}/{mode}: {r['output_tokens'] / r['seconds']:.0f} tok/s", flush=True)
    if scenario == "laptop-agent-restart":
        print_restart_table(SCENARIOS[scenario], [r])
    elif scenario in LAPTOP_SCENARIOS:
        print_laptop_table(scenario, [r])
    elif scenario != "chat":
        print_table(scenario, [r])  # each row as soon as its mode finishes
    return r


def print_results(scenario: str, results: list[dict], args):
    if scenario in LAPTOP_SCENARIOS:
        print_laptop_table(scenario, results)
    elif scenario == "chat":
        print_chat_table(results)
    else:
        print_table(scenario, results)
        if args.plot and results:
            plot(scenario, results, os.path.join(args.out_dir, f"bench_swap_{scenario}.png"))


def _strip_scenario(cmd: list[str]) -> list[str]:
    """Drop the parent's --scenario/--modes values so the child parses only its own --run-mode."""
    out, skip = [], False
    for c in cmd:
        if c in ("--scenario", "--modes"):
            skip = True
            continue
        if skip and not c.startswith("-"):  # -tp too
            continue
        skip = False
        out.append(c)
    return out


if __name__ == "__main__":
    sys.exit(main())
