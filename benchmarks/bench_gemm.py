"""Microbenchmark of the decode-step GEMMs at small M: cuBLAS (`F.linear`) against Triton tiles, with split-K.

    python benchmarks/bench_gemm.py [--shape qwen3-0.6b qwen3-8b] [--m 1 32 128 256]
    python benchmarks/bench_gemm.py --residual [--shape qwen3-8b] [--m 16 64 256 1024 16384]
    python benchmarks/bench_gemm.py --sustained [--shape qwen3-8b] [--m 512 1024 8192 16384]

Why: in a Qwen3-0.6B decode step the four GEMMs of a layer take ~21-28 us at M <= 128 on an H200 while their
weights (31 MB per layer) take ~8 us to read (docs/benchmarks.md). Each of them reads a few MB with only
N / BLOCK_N programs, too few to pull the weights at full bandwidth. Split-K gives each program a slice of K and
writes fp32 partial sums [S, M, N]; in the engine the consumer of each GEMM (the RMSNorm after o_proj and
down_proj, the rope + KV-store kernel after qkv_proj, SiLU-and-mul after gate_up_proj) could sum the S partials as
it reads its input, so no extra kernel would run. This prints, per shape and M: cuBLAS; the best plain Triton tile;
the best split-K tile alone ("fused reduce": what the engine would pay, plus reading the partials in the consumer);
and split-K followed by a separate sum (`torch.sum` over S), all timed inside CUDA graphs.

`--residual` times o_proj and down_proj (the GEMMs that feed the residual stream) three ways: alone, followed by a
separate residual add, and adding into the residual inside the GEMM (`residual.addmm_`, cuBLAS's beta = 1), as the
engine does (models/decoder.py). Why: the third must cost no more than the first for the fusion to pay.

`--sustained` instead runs a layer's four GEMMs (cuBLAS) back to back for 1.5 s per M, once on random inputs and once
with every input row the same, and prints TFLOP/s with the board power and SM clock sampled through NVML
(nvidia-ml-py) meanwhile. Why: a long run is held at the GPU's power limit, and tensor-core power depends on the
data, so short timings at full clock and inputs without variety both overstate what a run gets (docs/benchmarks.md).
"""
import argparse
import itertools
import threading
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {  # (N, K) of qkv_proj, o_proj, gate_up_proj, down_proj
    "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
}


@triton.jit
def _splitk_kernel(a_ptr, w_ptr, part_ptr, M, N, K, k_per_split, stride_am, stride_wn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[s] = a[:, Ks] @ w[:, Ks].T over split s's K range Ks (fp32); one split is a plain GEMM."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = split * k_per_split
    offs_k = k_start + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, k_per_split, BLOCK_K):
        a = tl.load(a_ptrs, mask=offs_m[:, None] < M, other=0.0)
        w = tl.load(w_ptrs, mask=offs_n[:, None] < N, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = part_ptr + (split * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def splitk_matmul(a: torch.Tensor, w: torch.Tensor, splits: int, block_m: int, block_n: int, block_k: int,
                  num_warps: int = 4, num_stages: int = 3, part: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 partial sums [splits, M, N] of a [M, K] @ w[N, K].T; K must split into whole BLOCK_K steps."""
    (m, k), n = a.shape, w.shape[0]
    assert k % (splits * block_k) == 0, (k, splits, block_k)
    if part is None:
        part = torch.empty((splits, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), splits)
    _splitk_kernel[grid](a, w, part, m, n, k, k // splits, a.stride(0), w.stride(0),
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
                         num_stages=num_stages)
    return part


def graph_us(fn) -> float:
    from triton.testing import do_bench_cudagraph
    return do_bench_cudagraph(fn, rep=10) * 1e3


def configs(m: int, k: int):
    """(splits, block_m, block_n, block_k) candidates for this M and K."""
    block_ms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, triton.next_power_of_2(m))]
    for splits, bm, bn, bk in itertools.product((1, 2, 4, 8), block_ms, (16, 32, 64, 128), (128, 256)):
        if k % (splits * bk) == 0 and (bm + bn) * bk <= 192 * 256 and (bn > 16 or bm <= 32):
            yield splits, bm, bn, bk


def bench_shape(n: int, k: int, m: int) -> str:
    w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    ref = F.linear(a, w).float()
    cublas = graph_us(lambda: F.linear(a, w))
    best = {}  # "plain" / "split": (us, config)
    for cfg in configs(m, k):
        splits = cfg[0]
        part = torch.empty((splits, m, n), dtype=torch.float32, device="cuda")
        try:
            got = splitk_matmul(a, w, *cfg, part=part).sum(0)
            us = graph_us(lambda: splitk_matmul(a, w, *cfg, part=part))
        except Exception:  # noqa: BLE001 -- a tile that does not fit (shared memory): skip it
            continue
        assert (got - ref).abs().max().item() <= 1e-2 * ref.abs().max().item() + 1e-3, cfg
        key = "plain" if splits == 1 else "split"
        if us < best.get(key, (float("inf"),))[0]:
            best[key] = (us, cfg)
    line = f"N={n:5d} K={k:5d} M={m:4d}: cuBLAS {cublas:6.1f} us"
    weight_us = n * k * 2 / 4.3e12 * 1e6
    if "plain" in best:
        line += f" | Triton {best['plain'][0]:6.1f} us {best['plain'][1][1:]}"
    if "split" in best:
        us, cfg = best["split"]
        part = torch.empty((cfg[0], m, n), dtype=torch.float32, device="cuda")
        with_sum = graph_us(lambda: splitk_matmul(a, w, *cfg, part=part).sum(0, dtype=torch.float32).bfloat16())
        line += f" | split-K {us:6.1f} us (S={cfg[0]}, {cfg[1:]}), + separate sum {with_sum:6.1f} us"
    return line + f" | weights at 4.3 TB/s {weight_us:5.1f} us"


def bench_residual(shape: str, m: int) -> str:
    """o_proj and down_proj at M rows: the GEMM alone, + a separate residual add, and adding inside the GEMM."""
    parts = []
    for name, (n, k) in (("o_proj", SHAPES[shape][1]), ("down_proj", SHAPES[shape][3])):
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        a = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        residual = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
        expected = (residual.float() + a.float() @ w.float().t())
        got = residual.clone().addmm_(a, w.t()).float()
        assert (got - expected).abs().max().item() <= 2e-2 * expected.abs().max().item(), name
        alone = graph_us(lambda: F.linear(a, w))
        separate = graph_us(lambda: residual.add_(F.linear(a, w)))
        inside = graph_us(lambda: residual.addmm_(a, w.t()))
        parts.append(f"{name} {alone:7.1f} / {separate:7.1f} / {inside:7.1f} us")
    return f"M={m:6d}: " + " | ".join(parts) + "  (alone / + separate add / add inside the GEMM)"


class PowerSampler:
    """Board power and SM clock sampled through NVML (nvidia-ml-py) every 50 ms while the `with` block runs;
    `summary()` gives their means over the second half (the first half lets the power limiter settle)."""

    def __init__(self, period_s: float = 0.05):
        self.period_s, self.samples, self._stop = period_s, [], threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        except Exception:  # noqa: BLE001 -- no nvidia-ml-py or no NVML: times only
            self._nvml = None

    def _sample(self):
        while not self._stop.is_set():
            self.samples.append((self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1e3,
                                 self._nvml.nvmlDeviceGetClockInfo(self._handle, self._nvml.NVML_CLOCK_SM)))
            time.sleep(self.period_s)

    def __enter__(self):
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._sample)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._nvml is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> str:
        tail = self.samples[len(self.samples) // 2:]
        if not tail:
            return "(no nvidia-ml-py: no power or clock)"
        return f"{sum(p for p, _ in tail) / len(tail):4.0f} W  SM {sum(c for _, c in tail) / len(tail):5.0f} MHz"


def hold(fn, seconds: float, repeats: int) -> tuple[float, str]:
    """Call fn `repeats` times per timed round, round after round for `seconds`: (ms per call in the last round,
    board power and SM clock over the second half)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with PowerSampler() as power:
        begin = time.perf_counter()
        while time.perf_counter() - begin < seconds:
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            end.synchronize()
    return start.elapsed_time(end) / repeats, power.summary()


def sustained_layer(shape: str, m: int, same_rows: bool, seconds: float = 1.5, only: int | None = None) -> str:
    """A layer's four GEMMs at M rows (`only`: just that one of them), back to back for `seconds`: TFLOP/s of the
    last 10 layers, and the mean board power and SM clock over the second half (NVML, every 50 ms)."""
    shapes = SHAPES[shape] if only is None else [SHAPES[shape][only]]
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for n, k in shapes]
    if same_rows:
        inputs = [torch.randn(1, k, dtype=torch.bfloat16, device="cuda").expand(m, k).contiguous()
                  for _, k in shapes]
    else:
        inputs = [torch.randn(m, k, dtype=torch.bfloat16, device="cuda") for _, k in shapes]
    outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for n, _ in shapes]

    def layer():
        for a, w, out in zip(inputs, weights, outs):
            torch.matmul(a, w.t(), out=out)

    ms, power = hold(layer, seconds, repeats=10)
    flops = 2 * m * sum(n * k for n, k in shapes)
    data = "same rows" if same_rows else "random"
    what = "layer" if only is None else f"GEMM (N={shapes[0][0]}, K={shapes[0][1]})"
    return f"M={m:6d} {data:9s}: {ms * 1e3:8.1f} us/{what} {flops / ms / 1e9:6.1f} TFLOP/s  {power}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="*", default=None, choices=list(SHAPES))
    parser.add_argument("--m", nargs="*", type=int, default=None)
    parser.add_argument("--residual", action="store_true", help="o_proj and down_proj adding into the residual")
    parser.add_argument("--sustained", action="store_true", help="a layer's GEMMs held for 1.5 s, power and clock")
    parser.add_argument("--each", action="store_true", help="with --sustained: also each GEMM alone (random inputs)")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    torch.manual_seed(0)
    if args.residual:
        for shape in args.shape or ["qwen3-8b"]:
            print(f"## {shape}, residual add", flush=True)
            for m in args.m or [16, 64, 256, 1024, 16384]:
                print(bench_residual(shape, m), flush=True)
        return
    if args.sustained:
        for shape in args.shape or ["qwen3-8b"]:
            print(f"## {shape}, sustained", flush=True)
            for m, same_rows in itertools.product(args.m or [512, 1024, 8192, 16384], (False, True)):
                print(sustained_layer(shape, m, same_rows), flush=True)
                time.sleep(0.5)  # let the board cool between cases
            for m, only in itertools.product(args.m or [512, 1024, 8192, 16384], range(4) if args.each else ()):
                print(sustained_layer(shape, m, False, only=only), flush=True)
                time.sleep(0.5)
        return
    for shape in args.shape or list(SHAPES):
        print(f"## {shape}", flush=True)
        for (n, k), m in itertools.product(SHAPES[shape], args.m or [1, 32, 128, 256]):
            print(bench_shape(n, k, m), flush=True)


if __name__ == "__main__":
    main()
