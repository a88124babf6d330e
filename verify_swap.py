"""Checks that the CPU swap tier works on this machine. Each check runs in its own process (a process that exits
frees its GPU memory; nanovllm.utils.fresh_process: it does not pay the engine's imports again) and prints PASS or
FAIL; CUDA-only checks are skipped without a GPU.

    python verify_swap.py [MODEL_DIR]     # default: the Qwen3-0.6B shape with dummy weights
"""
import argparse
import glob
import json
import multiprocessing
import os
import random
import sys
import time

from nanovllm.utils.fresh_process import start_fresh_process

CHECKS = ["kv_roundtrip", "resume_mid_decode", "heavy_swap", "counters", "bandwidth", "tp2", "fp8_kv_roundtrip",
          "fp8_resume_mid_decode"]
CUDA_ONLY = {"kv_roundtrip", "bandwidth", "tp2", "fp8_kv_roundtrip"}
MODEL = None  # the model directory of this process's check


GPU_MEMORY_GIB: float | None = None  # --gpu-memory-gib


def model_config(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def engine_args(model: str, cuda: bool, **overrides) -> dict:
    max_model_len = min(1024, model_config(model).get("max_position_embeddings", 1024))
    args = dict(load_format="auto" if glob.glob(os.path.join(model, "*.safetensors")) else "dummy",
                device="cuda" if cuda else "cpu", enforce_eager=not cuda, max_model_len=max_model_len, seed=0)
    if cuda and GPU_MEMORY_GIB is not None:
        args.update(gpu_memory_budget_gib=GPU_MEMORY_GIB)  # --gpu-memory-gib: every check inside that budget
    args.update(overrides)
    return args


def random_prompts(num: int, min_len: int, max_len: int, vocab: int = 10000, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = min(vocab, model_config(MODEL).get("vocab_size", vocab))
    return [[rng.randrange(vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(num)]


# --- the checks: each returns a detail string or raises AssertionError
def check_kv_roundtrip(model, cuda, **overrides):
    import torch
    from nanovllm import LLM
    with LLM(model, **engine_args(model, cuda, num_kvcache_blocks=16, swap_space=0.25, preemption_mode="swap",
                                  kvcache_block_size=16, **overrides)) as llm:
        kv, host = llm.runner.kv_cache, llm.runner.host_cache.kv
        assert host.is_pinned(), "host cache is not pinned"
        if kv.dtype == torch.uint8:  # FP8: raw bytes, each block's values then its scales
            kv.copy_(torch.randint(0, 256, kv.shape, dtype=torch.uint8, device=kv.device))
        else:
            kv.copy_(torch.randn(kv.shape, device=kv.device).to(kv.dtype))
        engine = llm.runner.copy_engine
        src, cpu, dst = [1, 3, 4, 7], [5, 0, 1, 2], [8, 9, 12, 2]
        engine.swap_out(list(zip(src, cpu)))
        engine.swap_in(list(zip(cpu, dst)))
        engine.synchronize()
        def bits(t):
            return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])
        for s, c, d in zip(src, cpu, dst):
            assert torch.equal(bits(host[c]), bits(kv[s].cpu())), f"gpu block {s} -> host block {c} differs"
            assert torch.equal(bits(kv[d]), bits(kv[s])), f"gpu block {s} -> host -> gpu block {d} differs"
        return f"{len(src)} blocks of {engine.block_bytes / 2**20:.2f} MiB round-tripped byte-exact"


def check_resume_mid_decode(model, cuda, **overrides):
    from nanovllm import LLM, SamplingParams
    prompt = random_prompts(1, 40, 40)[0]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(model, **engine_args(model, cuda, enable_prefix_caching=False, preemption_mode="swap",
                                  **overrides)) as llm:
        expected = llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
        seq_id = llm.add_request(prompt, params)
        seq = llm.requests[seq_id]
        while seq.num_completion_tokens < 20:
            llm.step()
        llm.scheduler.preempt(seq, mode="swap")
        assert seq.status.name == "SWAPPED", f"seq is {seq.status.name} after preempt"
        while not seq.is_finished:
            llm.step()
        got = llm.output(llm.requests.pop(seq_id))["token_ids"]
        stats = llm.stats()
    assert got == expected, f"tokens differ after swap: first mismatch at {_first_mismatch(got, expected)}"
    assert stats["blocks_swapped_in"] > 0 and stats["recomputed_tokens"] == 0, stats
    return (f"swapped out after 20 tokens, resumed, {len(got)} tokens identical, "
            f"blocks swapped in: {stats['blocks_swapped_in']}")


def check_fp8_kv_roundtrip(model, cuda):
    """An FP8 block (values, then one scale per token and kv head) to the pinned host pool and back, byte-exact."""
    return check_kv_roundtrip(model, cuda, kv_cache_dtype="fp8")


def check_fp8_resume_mid_decode(model, cuda):
    """With FP8 KV, a sequence swapped out mid-decode and resumed continues exactly as one that never left."""
    return check_resume_mid_decode(model, cuda, kv_cache_dtype="fp8")


def _heavy_workload(cuda):
    from nanovllm import SamplingParams
    num, max_len, max_tokens = (64, 300, 128) if cuda else (8, 40, 24)
    prompts = random_prompts(num, max_len // 3, max_len)
    return prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def check_heavy_swap(model, cuda, tp: int = 1):
    from nanovllm import LLM
    prompts, params = _heavy_workload(cuda)
    common = dict(dtype="float32", kvcache_block_size=16)
    with LLM(model, **engine_args(model, cuda, **common)) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    num_blocks = 48 if cuda else 12
    start = time.perf_counter()
    with LLM(model, **engine_args(model, cuda, num_kvcache_blocks=num_blocks, preemption_mode="swap",
                                  tensor_parallel_size=tp, **common)) as llm:
        got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats()
    bad = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    assert not bad, f"{len(bad)} of {len(prompts)} sequences differ from the unpressured run, e.g. seq {bad[0]}"
    assert stats["preemptions_swap"] > 0, f"no swap happened: {stats}"
    return (f"{len(prompts)} seqs, {stats['preemptions_swap']} swap preemptions, "
            f"blocks swapped in: {stats['blocks_swapped_in']}, outputs identical, {time.perf_counter() - start:.1f} s")


def check_counters(model, cuda):
    from nanovllm import LLM
    prompts, params = _heavy_workload(cuda)
    with LLM(model, **engine_args(model, cuda, num_kvcache_blocks=48 if cuda else 12, preemption_mode="swap",
                                  kvcache_block_size=16, enable_prefix_caching=False)) as llm:
        llm.generate(prompts, params, use_tqdm=False)
        s = llm.stats()
        block_bytes = llm.block_bytes
        engine = llm.runner.copy_engine  # what the copies moved, counted where they are issued
        copied = (engine.bytes_out, engine.bytes_in)
    assert s["preemptions"] == s["preemptions_swap"] + s["preemptions_recompute"], s
    assert s["preemptions_swap"] > 0 and s["blocks_swapped_out"] > 0 and s["blocks_swapped_in"] > 0, s
    assert s["blocks_swapped_in"] == s["blocks_swapped_out"], "without prefix caching every block out comes back in"
    scheduled = (s["blocks_swapped_out"] * block_bytes, s["blocks_swapped_in"] * block_bytes)
    assert copied == scheduled, f"the copy engine moved {copied} bytes (out, in), the scheduler asked for {scheduled}"
    assert s["swap_seconds"] > 0 and s["recomputed_tokens"] == 0, s
    return ", ".join(f"{k}={s[k]:.4g}" if isinstance(s[k], float) else f"{k}={s[k]}" for k in
                     ("preemptions_swap", "blocks_swapped_out", "blocks_swapped_in", "bytes_swapped_out",
                      "swap_seconds", "swap_exposed_seconds"))


def check_bandwidth(model, cuda):
    import torch
    from nanovllm import LLM
    with LLM(model, **engine_args(model, cuda, kv_cache_memory_bytes=6 << 30, swap_space=4.0,
                                  preemption_mode="swap")) as llm:
        engine = llm.runner.copy_engine
        num = min(llm.runner.host_cache.num_blocks, llm.num_gpu_blocks)
        rng = random.Random(0)
        gpu_ids, cpu_ids = rng.sample(range(llm.num_gpu_blocks), num), rng.sample(range(num), num)
        nbytes = num * engine.block_bytes
        results = {}
        for direction in ("out", "in"):
            best = 0.0
            for _ in range(3):
                before = engine.copy_seconds
                if direction == "out":
                    engine.swap_out(list(zip(gpu_ids, cpu_ids)))
                else:
                    engine.swap_in(list(zip(cpu_ids, gpu_ids)))
                engine.synchronize()
                best = max(best, nbytes / (engine.copy_seconds - before))
            results[direction] = best
        gpu = llm.runner.kv_cache[:num]
        host = llm.runner.host_cache.kv[:num]
        for direction, (dst, src) in (("memcpy_out", (host, gpu)), ("memcpy_in", (gpu, host))):
            best = 0.0
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                best = max(best, nbytes / (start.elapsed_time(end) / 1e3))
            results[direction] = best
    ratio_out, ratio_in = results["out"] / results["memcpy_out"], results["in"] / results["memcpy_in"]
    detail = (f"{nbytes / 2**30:.2f} GiB in {num} scattered blocks: swap-out {results['out'] / 1e9:.1f} GB/s vs "
              f"memcpy {results['memcpy_out'] / 1e9:.1f} ({ratio_out:.0%}); swap-in {results['in'] / 1e9:.1f} vs "
              f"{results['memcpy_in'] / 1e9:.1f} ({ratio_in:.0%})")
    assert min(ratio_out, ratio_in) >= 0.9, detail
    return detail


def check_tp2(model, cuda):
    import torch

    from nanovllm.config import Config
    if torch.cuda.device_count() < 2:
        return "SKIP: fewer than 2 GPUs"
    try:
        Config(model, tensor_parallel_size=2)
    except ValueError as e:  # e.g. SmolLM2's 9 heads
        return f"SKIP: this model does not split over 2 GPUs ({e})"
    return check_heavy_swap(model, cuda, tp=2)


def _first_mismatch(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_one(name: str, model: str, gpu_memory_gib: float | None) -> dict:
    """One check in this process: {"ok": ..., "detail": ...}."""
    import torch
    global MODEL, GPU_MEMORY_GIB
    MODEL, GPU_MEMORY_GIB = model, gpu_memory_gib
    cuda = torch.cuda.is_available()
    try:
        return {"ok": True, "detail": globals()[f"check_{name}"](model, cuda)}
    except AssertionError as e:
        return {"ok": False, "detail": str(e)}


def _check_process(conn, name: str, model: str, gpu_memory_gib: float | None):
    conn.send(run_one(name, model, gpu_memory_gib))


def run_in_own_process(name: str, args) -> dict:
    """A check in a fresh process (nanovllm.utils.fresh_process); a timeout (deadlock) or a crash fails it."""
    recv, send = multiprocessing.Pipe(duplex=False)
    proc = start_fresh_process(_check_process, (send, name, args.model, args.gpu_memory_gib))
    send.close()
    reported = recv.poll(args.timeout)
    result = recv.recv() if reported else None
    proc.join(5 if reported else 0)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if not reported:
        return {"ok": False, "detail": f"timed out after {args.timeout} s (deadlock?)" if proc.exitcode == -9
                else f"its process ended (exit code {proc.exitcode}) before it reported; its stderr is above"}
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--only", nargs="*", default=None, choices=CHECKS)
    parser.add_argument("--timeout", type=int, default=600, help="seconds per check (a deadlock fails)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="run every check as if the GPU had this many GiB (gpu_memory_budget_gib)")
    args = parser.parse_args()
    if args.model is None:
        from nanovllm.utils.presets import preset_dir
        args.model = preset_dir("qwen3-0.6b")
    import torch
    cuda = torch.cuda.is_available()
    print(f"verify_swap: model={args.model} device={'cuda: ' + torch.cuda.get_device_name() if cuda else 'cpu'}")
    failed = 0
    for name in args.only or CHECKS:
        if name in CUDA_ONLY and not cuda:
            print(f"SKIP {name}: needs CUDA")
            continue
        start = time.perf_counter()
        result = run_in_own_process(name, args)
        seconds = time.perf_counter() - start
        skipped = str(result["detail"]).startswith("SKIP")
        status = "SKIP" if skipped else "PASS" if result["ok"] else "FAIL"
        failed += status == "FAIL"
        print(f"{status} {name} ({seconds:.1f} s): {result['detail']}", flush=True)
    sys.exit(1 if failed else 0)

if __name__ == "__main__":
    main()
