"""The CPU engine's intra-op thread count: 64 greedy tokens from SmolLM2-135M-Instruct at each thread count, with the
machine idle and with a busy loop on one core, one after the other in a single run.

Each measurement is a fresh process (torch fixes its thread pool at the first parallel op), so the numbers include
nothing that an earlier one warmed. A process reports the engine's start-up (weights, KV), the prefill of the
prompt and the 64 decode steps separately; the decode rate is what the thread count changes.

    python -m benchmarks.bench_cpu_threads --threads 1 2 auto --repeats 2

A number sets OMP_NUM_THREADS; "auto" leaves the count to the engine (nanovllm/utils/cpu_threads.py); "torch" is
torch's own default (one thread per core of the affinity mask), what the engine ran with before it chose.
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

PROMPT = "Write a short story about a lighthouse keeper."
BUSY_LOOP = "while 1: pass"


def print_machine():
    print(f"# {os.uname().nodename}, usable cores {len(os.sched_getaffinity(0))}, "
          f"{time.strftime('%Y-%m-%d %H:%M')} UTC", flush=True)


@contextlib.contextmanager
def machine_load(load: str):
    """"idle": nothing of ours beside the measurement; "busy": BUSY_LOOP on one core until the block ends."""
    busy = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if load == "busy" else None
    try:
        yield
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def child(threads: str, num_tokens: int):
    """One measurement, printed as a JSON line."""
    options = {}
    if threads == "torch":  # torch's own default, what the engine ran with before it chose
        options["cpu_threads"] = len(os.sched_getaffinity(0))
    elif threads != "auto":
        os.environ["OMP_NUM_THREADS"] = threads
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.convert import default_model_dir
    import torch
    start = time.perf_counter()
    llm = LLM(default_model_dir(), device="cpu", max_model_len=512, max_num_seqs=4, num_kvcache_blocks=64,
              **options)
    loaded = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # the prefill alone
    prefilled = time.perf_counter()
    llm.generate([PROMPT + " "], params, use_tqdm=False)
    done = time.perf_counter()
    llm.close()
    print(json.dumps(dict(threads=threads, torch_threads=torch.get_num_threads(), start_s=loaded - start,
                          prefill_s=prefilled - loaded, generate_s=done - prefilled,
                          tokens_per_s=num_tokens / (done - prefilled))))


def measure(threads: str, num_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    load_before = os.getloadavg()[0]
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_cpu_threads", "--child", threads,
                          "--num-tokens", str(num_tokens)], env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(result, loadavg_1min=round(load_before, 2))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", nargs="+", default=["1", "2", "auto"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-tokens", type=int, default=64)
    parser.add_argument("--loads", nargs="+", default=["idle", "busy"], choices=["idle", "busy"])
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return child(args.child, args.num_tokens)
    print_machine()
    for load in args.loads:
        with machine_load(load):
            for _ in range(args.repeats):
                for threads in args.threads:  # interleaved, so a change in the machine's load hits every count
                    print(json.dumps(dict(load=load, **measure(threads, args.num_tokens))), flush=True)


if __name__ == "__main__":
    main()
