"""nano-vllm's seed benchmark with dummy weights: output tokens, seconds, tok/s, host time per decode step, and the
least time the decode steps' KV and weight reads allow at the copy bandwidth measured in the same process.

    python bench.py                                   # Qwen3-0.6B shape, 256 seqs
    python bench.py --shape qwen3-8b --num-seqs 1024  # the H800 workload
    python bench.py --profile-decode 32 256 64:1500   # also: decode-step time and kernels at these batch sizes
                                                      # (1,000 tokens of context a row, or as given)
    python bench.py --profile-mixed 32:1024 0:560x29  # ... and of steps with 32 decode rows + a 1,024-token prompt,
                                                      # and of a prefill of 29 prompts of 560 tokens
    python bench.py --variants "" "NANOVLLM_DECODE_TILE=16,32,4,3" --repeat 2
                                                      # each variant (environment settings) in its own process,
                                                      # alternating, then tok/s against the first
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

from nanovllm import LLM, SamplingParams
from nanovllm.engine import engine_core, model_runner
from nanovllm.engine.step_plan import StepPlan
from nanovllm.config import KV_CACHE_DTYPES
from nanovllm.core.request_metrics import latency_summary
from nanovllm.utils.presets import preset_dir


def seed_workload(num_seqs: int, max_input_len: int = 1024, max_output_len: int = 1024, temperature: float = 0.6):
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, max_input_len))] for _ in range(num_seqs)]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=random.randint(100, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


class HostTimer:
    """Wall time of the host-side work of decode-only steps: schedule, step plan, input tensors, sampling
    parameters, advance and resolve (what postprocess was); and on CUDA each step's GPU time (events around what
    `launch` enqueues: from the end of the step before to the end of this one's sampler)."""

    POSTPROCESS = ("advance", "resolve")  # the rest is scheduling and input preparation

    def __init__(self, llm):
        self.seconds, self.num_steps = 0.0, 0
        self.postprocess_seconds = 0.0  # part of `seconds`: advance + resolve
        self.decode_wall_seconds = self.prefill_wall_seconds = 0.0
        self.decode_context_tokens = 0  # KV tokens the decode steps read, summed over steps (every layer reads them)
        # per step: (is_decode, num_seqs, num_tokens, wall seconds, scheduling + input preparation seconds,
        # GPU seconds (None without CUDA; filled in by gpu_seconds()))
        self.trace = []
        self.step_prep_seconds = 0.0
        self.step_parts = {}  # this step's seconds per wrapped function
        self.parts = []  # per step (as the trace): step_parts
        self.step_events = None
        self.events = []  # per step: (start, end) CUDA events, or None
        step = llm.step

        def timed_step():
            self.step_prep_seconds, self.step_parts = 0.0, {}
            start = time.perf_counter()
            finished = step()
            wall_seconds = time.perf_counter() - start
            if self.is_decode:
                self.decode_wall_seconds += wall_seconds
            else:
                self.prefill_wall_seconds += wall_seconds
            self.trace.append([self.is_decode, self.num_seqs, self.num_tokens, wall_seconds, self.step_prep_seconds,
                               None])
            self.events.append(self.step_events)
            self.parts.append(self.step_parts)
            self.step_events = None
            return finished
        llm.step = timed_step
        if llm.runner.device.type == "cuda":
            import torch
            launch = llm.runner.launch

            def timed_launch(*args, **kwargs):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = launch(*args, **kwargs)
                end.record()
                self.step_events = (start, end)
                return result
            llm.runner.launch = timed_launch
        self._wrap(llm.scheduler, "schedule")
        self._wrap(engine_core, "make_plan")
        self._wrap(model_runner, "prepare_step_inputs")
        self._wrap(llm.runner.sampling, "sampling_tensors")
        self._wrap(llm.scheduler, "advance")
        self._wrap(llm.scheduler, "resolve")

    def _wrap(self, obj, name):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            if name == "schedule":
                self.is_decode = result.is_decode_only and bool(result.seqs)
                self.num_seqs, self.num_tokens = len(result.seqs), sum(result.num_new_tokens)
                self.num_steps += self.is_decode
            if self.is_decode:
                seconds = time.perf_counter() - start
                if name == "make_plan":  # outside the timed part: every row reads its whole context
                    self.decode_context_tokens += sum(result[0].seq_lens)
                self.seconds += seconds
                self.step_parts[name] = self.step_parts.get(name, 0.0) + seconds
                if name in self.POSTPROCESS:
                    self.postprocess_seconds += seconds
                else:
                    self.step_prep_seconds += seconds
            return result
        self.is_decode, self.num_seqs, self.num_tokens = False, 0, 0
        setattr(obj, name, timed)

    def gpu_seconds(self) -> tuple[float, float] | None:
        """(decode, prefill/mixed) GPU seconds summed over the steps, after the run; fills the trace's last column."""
        last = next((events for events in reversed(self.events) if events is not None), None)
        if last is None:
            return None
        last[1].synchronize()
        totals = [0.0, 0.0]
        for row, events in zip(self.trace, self.events):
            if events is not None:
                row[5] = events[0].elapsed_time(events[1]) / 1e3
                totals[0 if row[0] else 1] += row[5]
        return totals[0], totals[1]


def step_plan(num_decode: int, context_len: int, prefill_len: int, block_size: int, num_prompts: int = 1,
              vocab_size: int = 10001) -> StepPlan:
    """`num_decode` decode rows with `context_len` tokens each, then (prefill_len > 0) `num_prompts` prompts of
    prefill_len new tokens each; every sequence in its own consecutive blocks; token ids below vocab_size."""
    plan, next_block = StepPlan(), 0
    rng = random.Random(0)  # token ids as the seed workload draws them: the GEMMs' power draw depends on the data
    rows = [(context_len - 1, 1)] * num_decode + ([(0, prefill_len)] * num_prompts if prefill_len else [])
    for start, n in rows:
        table = list(range(next_block, next_block - (-(start + n) // block_size)))
        next_block += len(table)
        plan.input_ids += [rng.randint(0, min(10000, vocab_size - 1)) for _ in range(n)]
        plan.positions += list(range(start, start + n))
        plan.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        plan.query_lens.append(n)
        plan.seq_lens.append(start + n)
        plan.block_tables.append(table)
        plan.logits_indices.append(len(plan.input_ids) - 1)
    return plan


def profile_step(runner, num_decode: int, prefill_len: int = 0, context_len: int = 1000, num_iters: int = 30,
                 num_prompts: int = 1):
    """Time the step the engine runs (prepare, forward -- a graph replay when decode-only --, LM head, sampler) back
    to back, as async scheduling issues them, then list its top kernels. Writes into the (now free) KV blocks."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from nanovllm.layers.sampler import SamplingTensors
    plan = step_plan(num_decode, context_len, prefill_len, runner.block_size, num_prompts,
                     runner.config.hf_config.vocab_size)
    name = f"step: {num_decode} decode rows (context {context_len}) + {num_prompts} x {prefill_len}-token prompts"
    if sum(len(t) for t in plan.block_tables) > runner.kv_cache.size(0):
        print(f"{name}: does not fit in the KV cache; skipped")
        return
    num_rows = len(plan.logits_indices)
    sampling = SamplingTensors(torch.full((num_rows,), 0.6, device=runner.device), None, None, None, None, False)
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else (lambda: None)

    def step():
        with torch.inference_mode():
            logits, _ = runner.forward(plan)  # (sampled rows' logits, prompt logprobs)
            runner.sampler(logits, sampling)
    for _ in range(3):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(num_iters):
        step()
    sync()
    ms = 1e3 * (time.perf_counter() - start) / num_iters
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            step()
        sync()
    kernels = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / 5
    launches = sum(e.count for e in kernels) / 5
    print(f"{name}: {ms:.3f} ms per step back to back; kernels {kernel_ms:.3f} ms in {launches:.0f} launches")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
    if prefill_len:  # where the host time goes
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))


def run(llm, args):
    """The timed seed workload: prints throughput and host time per decode step."""
    prompts, params = seed_workload(args.num_seqs)
    timer = HostTimer(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_tokens = sum(p.max_tokens for p in params)
    lat = latency_summary([o["metrics"] for o in outputs])
    stats = llm.stats()
    print(f"shape={args.shape} seqs={args.num_seqs} tp={args.tensor_parallel_size} backend={llm.runner.backend.name} "
          f"gpu_blocks={stats['num_gpu_blocks']} preemptions={stats['preemptions']}")
    print(f"Total: {num_tokens} tok, Time: {seconds:.2f} s, "
          f"Throughput: {num_tokens / seconds:.0f} tok/s, "
          f"host time per decode step: {1e3 * timer.seconds / max(timer.num_steps, 1):.3f} ms "
          f"over {timer.num_steps} steps")
    print(f"TTFT p50 {lat['ttft_p50']:.3f} s, p99 {lat['ttft_p99']:.3f} s; "
          f"inter-token p50 {1e3 * lat['itl_p50']:.2f} ms, p99 {1e3 * lat['itl_p99']:.2f} ms")
    prep_ms = 1e3 * (timer.seconds - timer.postprocess_seconds) / max(timer.num_steps, 1)
    post_ms = 1e3 * timer.postprocess_seconds / max(timer.num_steps, 1)
    print(f"  of which scheduling + input preparation {prep_ms:.3f} ms, advance + read-back {post_ms:.3f} ms")
    full = [i for i, t in enumerate(timer.trace) if t[0] and t[1] >= 0.9 * args.num_seqs]  # decode, (nearly) full
    if full:
        full_ms = 1e3 * sum(timer.trace[i][4] for i in full) / len(full)
        print(f"  scheduling + input preparation at batch >= {0.9 * args.num_seqs:.0f}: {full_ms:.3f} ms per step "
              f"over {len(full)} steps")
        names = dict.fromkeys(name for i in full for name in timer.parts[i])
        parts = ", ".join(f"{name} {1e3 * sum(timer.parts[i].get(name, 0.0) for i in full) / len(full):.3f}"
                          for name in names)
        print(f"    per function, ms per step: {parts}")
    per_step_ms = 1e3 * timer.decode_wall_seconds / max(timer.num_steps, 1)
    print(f"wall time in decode steps {timer.decode_wall_seconds:.2f} s ({per_step_ms:.2f} ms/step), "
          f"in prefill/mixed steps {timer.prefill_wall_seconds:.2f} s")
    gpu = timer.gpu_seconds()
    if gpu is not None:
        print(f"GPU time in decode steps {gpu[0]:.2f} s, in prefill/mixed steps {gpu[1]:.2f} s")
    if llm.runner.device.type == "cuda":
        from nanovllm.engine.memory_profile import non_torch_bytes, stack_limit_bytes
        outside_torch = non_torch_bytes(llm.runner.config, llm.runner.device)
        print(f"CUDA's own memory after the run: {outside_torch / 2**30:.2f} GiB "
              f"(per-thread stack limit {stack_limit_bytes(llm.runner.device)} B)")
    print(decode_traffic_bound(llm, timer))
    if llm.runner.device.type == "cuda":
        import torch
        mem = torch.cuda.memory_stats(llm.runner.device)
        # a retry frees the allocator's cached blocks and synchronizes the device: steps stop overlapping the host
        print(f"allocator: {mem.get('num_alloc_retries', 0)} retries, {mem.get('num_device_alloc', 0)} device "
              f"allocations, peak {mem.get('allocated_bytes.all.peak', 0) / 2**30:.1f} GiB allocated, "
              f"{mem.get('reserved_bytes.all.peak', 0) / 2**30:.1f} GiB reserved")
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(timer.trace, f)


def print_memory(llm):
    """Where the GPU memory went at start-up (the engine's sizing terms), GiB."""
    if llm.memory_breakdown is not None:
        print("memory GiB: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in llm.memory_breakdown.items()
                                         if k != "num_blocks") + f"; {llm.memory_breakdown['num_blocks']} KV blocks")


def copy_bandwidth(device, num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes read + written per second by a large `copy_` on the device, the best of a few."""
    import torch
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def decode_traffic_bound(llm, timer) -> str:
    """The least time the decode steps could take: every step reads each row's whole context of KV (all layers)
    and the weights once (the input embedding excepted: a lookup reads only its rows), at this device's copy
    bandwidth measured here. The decode kernel reaches ~98% of that rate and a read-only kernel ~106%, so a run
    well above 100% of the bound skipped reads it needed: check its outputs."""
    runner = llm.runner
    kv_bytes = timer.decode_context_tokens * runner.block_bytes / runner.block_size
    model = runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.tie_word_embeddings:
        weight_bytes -= model.model.embed_tokens.weight.numel() * model.model.embed_tokens.weight.element_size()
    # inside a --gpu-memory-gib budget the KV leaves no room for 2 GiB of buffers; 256 MiB is still 5x the L2
    bandwidth = copy_bandwidth(runner.device, (1 << 28) if runner.config.gpu_memory_budget_gib else (1 << 30))
    least_seconds = (kv_bytes + timer.num_steps * weight_bytes) / bandwidth
    share = least_seconds / max(timer.decode_wall_seconds, 1e-9)
    line = (f"decode steps read {kv_bytes / 1e12:.2f} TB of KV and {timer.num_steps} x {weight_bytes / 1e9:.2f} GB "
            f"of weights: at least {least_seconds:.2f} s at the {bandwidth / 1e9:.0f} GB/s copy bandwidth measured "
            f"here; they took {timer.decode_wall_seconds:.2f} s ({share:.0%} of that bound)")
    if share > 1.1:
        line += "\n  FASTER THAN THE BOUND ALLOWS: some kernel skipped reads it needed; check the outputs"
    return line


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=1024,
                        help="vLLM 0.26's default on a GPU of 70 GB or more, under which its reference numbers were "
                             "measured (the engine's own default is nano-vllm's 512, or 256 under 70 GiB)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: the engine's (16,384; 8,192 on a GPU or --gpu-memory-gib under 70 GiB)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kvcache-block-size", type=int, default=None, help="default: the engine's (64)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--profile-decode", nargs="*", default=(), metavar="BATCH[:CONTEXT]",
                        help="after the run, time decode steps (forward + sampling) at these batch sizes, each row "
                             "with CONTEXT tokens (default 1,000), and print their top CUDA kernels (torch.profiler)")
    parser.add_argument("--profile-mixed", nargs="*", default=(), metavar="ROWS:TOKENS[xPROMPTS]",
                        help="likewise for steps of ROWS decode rows plus PROMPTS (default 1) prompts of TOKENS new "
                             "tokens each")
    parser.add_argument("--skip-run", action="store_true", help="only the profiles")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                        help="schedule step N+1 while step N runs (default: on at TP 1)")
    parser.add_argument("--trace", default=None,
                        help="write per-step (is_decode, seqs, tokens, wall seconds, scheduling + input preparation "
                             "seconds, GPU seconds) JSON here")
    parser.add_argument("--variants", nargs="+", default=None, metavar="ENV",
                        help="run the benchmark once per variant, each a space-separated list of NAME=VALUE "
                             "environment settings (\"\" is the default), in separate processes, alternating")
    parser.add_argument("--repeat", type=int, default=1, help="with --variants: rounds over the variants")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="run as if the GPU had this many GiB (gpu_memory_budget_gib)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="the share of the GPU (or of --gpu-memory-gib) the engine may use")
    parser.add_argument("--quantize-lm-head", default=None, choices=["int8"],
                        help="the LM head (and embedding) in int8 (quantize_lm_head)")
    parser.add_argument("--offload-embedding", action="store_true",
                        help="the input embedding in pinned host memory (offload_embedding; untied models)")
    args = parser.parse_args()
    if args.variants and _VARIANT_CHILD not in os.environ:
        return run_variants(args.variants, args.repeat)
    if (args.profile_decode or args.profile_mixed) and args.tensor_parallel_size > 1:
        raise SystemExit("--profile-decode / --profile-mixed run rank 0's forward alone: use --tensor-parallel-size 1")
    batch_tokens = ({} if args.max_num_batched_tokens is None  # None: the engine's default, which goes by the card
                    else {"max_num_batched_tokens": args.max_num_batched_tokens})
    llm = LLM(preset_dir(args.shape), load_format="dummy", max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager, **batch_tokens,
              attention_backend=args.attention_backend, tensor_parallel_size=args.tensor_parallel_size,
              preemption_mode="recompute", async_scheduling=args.async_scheduling,
              kvcache_block_size=args.kvcache_block_size, kv_cache_dtype=args.kv_cache_dtype,
              gpu_memory_budget_gib=args.gpu_memory_gib,
              gpu_memory_utilization=args.gpu_memory_utilization, quantize_lm_head=args.quantize_lm_head,
              offload_embedding=args.offload_embedding)
    print_memory(llm)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    if not args.skip_run:
        run(llm, args)
    for spec in args.profile_decode:
        batch, _, context_len = spec.partition(":")
        profile_step(llm.runner, int(batch), context_len=int(context_len or 1000))
    for spec in args.profile_mixed:
        num_decode, prompts = spec.split(":")
        prefill_len, _, num_prompts = prompts.partition("x")
        profile_step(llm.runner, int(num_decode), int(prefill_len), num_prompts=int(num_prompts or 1))
    llm.close()


_VARIANT_CHILD = "NANOVLLM_BENCH_VARIANT_CHILD"  # set in the processes that run_variants starts


def run_variants(variants: list[str], repeat: int):
    """Side by side: this benchmark in a fresh process per variant (environment settings), alternating, so that
    a drifting machine hits every variant alike; prints each run's output and then tok/s against the first."""
    argv = sys.argv[1:]  # as given: the child sees _VARIANT_CHILD and ignores --variants and --repeat
    results = {v: [] for v in variants}
    num_failed = 0
    for round_index in range(repeat):
        for variant in variants:
            env = dict(os.environ, **dict(item.split("=", 1) for item in variant.split()), **{_VARIANT_CHILD: "1"})
            proc = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True)
            print(f"## [{variant or 'default'}] round {round_index + 1}\n{proc.stdout}", flush=True)
            if proc.returncode:
                print(proc.stderr[-3000:], flush=True)
                num_failed += 1
            found = re.search(r"Throughput: (\d+) tok/s", proc.stdout)
            if found:
                results[variant].append(int(found.group(1)))
    base = results[variants[0]]
    for variant, values in results.items():
        mean = sum(values) / max(len(values), 1)
        ratio = f"{mean / (sum(base) / len(base)):.3f}x" if base and values else "-"
        print(f"{variant or 'default':60s} tok/s {values}  mean {mean:,.0f}  ({ratio} the first)")
    return 1 if num_failed else 0


if __name__ == "__main__":
    sys.exit(main())
