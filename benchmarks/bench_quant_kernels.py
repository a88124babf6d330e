"""Microbenchmark of the quantized linear kernels (nanovllm/kernels/quant_matmul.py) against bf16 cuBLAS, on the
Qwen3-8B layer shapes, decode (M = 1..16) and prefill/batch (M = 128..8192) rows.

    python benchmarks/bench_quant_kernels.py [--m 1 16 1024] [--shapes qkv o] [--json OUT] [--budget-s 160]
    python benchmarks/bench_quant_kernels.py --sweep-splits  # decode split-K counts for W4 and block FP8
    python benchmarks/bench_quant_kernels.py --sweep-w4 --budget-s 100  # W4 decode tiles (sweep_w4.py)

Variants: bf16 `F.linear`; `int_linear` 4-bit (at 1-2 rows a CUDA-core kernel; `w4-mma` and `fp8blk-mma` time the
16-row dot kernel there instead; from DEQUANT_GEMM_MIN_ROWS rows on the weight dequantized to bf16 and cuBLAS,
`w4-tile` and `w8-tile` time the Triton 128-row tiles there instead) and 8-bit, group 128 with fp16 scales and fp32
mins (AWQ's and GPTQ's layout after repacking); `w8head`, int8 with a scale per row and no mins (the LM head of
`--quantize-lm-head int8`; at one row the CUDA-core 8-bit kernel; `--shapes head` times it at the head's shape);
`fp8_linear` with 128 x 128 blocks and per-channel (from
FP8_ACT_QUANT_MIN_ROWS = 33 rows these quantize the activations to FP8 and call torch._scaled_mm); and, from 16 rows
(W8A8_TRIAL_MIN_ROWS, to place FP8_ACT_QUANT_MIN_ROWS), the alternatives to the dispatch's pick: the Triton FP8 GEMM
for per-channel weights (`fp8ch-tri`) and for block weights (`fp8blk-tri`; NANOVLLM_FP8_BLOCK_SCALED_MM=0 makes it
the default), torch._scaled_mm's 1 x 128 / 128 x 128 block scaling forced (`fp8blk-smm`, cuBLASLt on sm_90: the
default there) and the weight-only kernel on block FP8 weights (`fp8blk-a16`, bf16 activations).

Each cell is `us / speedup over bf16 / %` where % is, for M <= 16, the bytes of weights + scales + mins read per
second as a share of the device's copy bandwidth (a 1 GiB device-to-device copy_, read + write bytes over time,
measured in the same run), and for larger M the TFLOP/s. The issue's targets: W4 >= 75% and FP8 >= 80% of copy
bandwidth at 1-16 rows; FP8 well above 1x bf16 at M = 1024..8192.

Timing: each variant is captured in a CUDA graph of as many calls as it takes to cycle through copies of the
weights totalling >= 256 MB (so the weights come from memory, not from the 50 MB L2), replayed 5 times; the median
per call is printed. Correctness: at M = 1, 16 and 1024 each result is compared once with x @ W.T in fp32 with W
dequantized by the contract's formula (max |error| / max |reference|); FP8-activation variants include the
activation rounding (~2^-5). A failing variant prints ERR and its error at the end, the others go on.
"""
import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanovllm.kernels import quant_gemm
from nanovllm.kernels import quant_matmul as qm
from nanovllm.kernels import quant_plans

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),  # (N, K)
          "head": (151936, 4096)}  # the LM head: not in the default run (--shapes head)
DECODE_M = [1, 2, 4, 8, 16]
PREFILL_M = [128, 512, 1024, 4096, 8192]
CHECK_M = (1, 16, 1024)
GROUP = 128
L2_DEFEAT_BYTES = 256 << 20
VARIANTS = ["bf16", "w4", "w4-mma", "w4-tile", "w8", "w8-tile", "w8head", "fp8blk",
            "fp8blk-mma", "fp8ch", "fp8ch-tri", "fp8blk-smm", "fp8blk-tri", "fp8blk-a16"]
LARGE_M_ONLY = {"fp8ch-tri", "fp8blk-smm", "fp8blk-tri", "fp8blk-a16"}
# the forced W8A8 variants also run from this many rows, below FP8_ACT_QUANT_MIN_ROWS: where the threshold belongs
W8A8_TRIAL_MIN_ROWS = 16
SMALL_M_ONLY = {"w4-mma", "fp8blk-mma"}  # the 16-row dot kernel where the plan takes a CUDA-core one (1-2 rows)
# the Triton tile kernels where int_linear dequantizes the weight and calls cuBLAS instead (DEQUANT_GEMM_MIN_ROWS)
TILE_KINDS = {"w4-tile": quant_gemm.KIND_INT4, "w8-tile": quant_gemm.KIND_INT8}
DEVICE = "cuda"  # the CPU smoke check of the references sets "cpu" (with TRITON_INTERPRET=1)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> [N, K] values 0..15, nibble j of word w is column 8 w + j (the contract)."""
    shifts = torch.arange(0, 32, 4, device=words.device, dtype=torch.int32)
    return ((words[..., None] >> shifts) & 0xF).flatten(-2)


def make_weights(variant: str, N: int, K: int) -> dict:
    """One copy of a variant's weight tensors, and its dequantized fp32 reference builder."""
    dev = DEVICE
    if variant == "bf16":
        return {"w": torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02}
    if variant in ("w4", "w4-mma", "w4-tile", "w8", "w8-tile"):
        if not variant.startswith("w8"):
            qweight = torch.randint(-2 ** 31, 2 ** 31 - 1, (N, K // 8), device=dev, dtype=torch.int32)
        else:
            qweight = torch.randint(-128, 128, (N, K), device=dev, dtype=torch.int8)
        scales = (torch.rand(N, K // GROUP, device=dev) * 0.004 + 0.001).half()
        mins = torch.randn(N, K // GROUP, device=dev) * 0.01
        return {"qweight": qweight, "scales": scales, "mins": mins}
    if variant == "w8head":  # --quantize-lm-head int8's layout: per row, no mins
        return {"qweight": torch.randint(-127, 128, (N, K), device=dev, dtype=torch.int8),
                "scales": torch.rand(N, 1, device=dev) * 1e-3 + 1e-4}
    block = (128, 128) if variant.startswith("fp8blk") else (1, K)
    qweight = (torch.randn(N, K, device=dev) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(math.ceil(N / block[0]), math.ceil(K / block[1]), device=dev) * 1e-3 + 1e-4
    return {"qweight": qweight, "scales": scales, "block": block}


def dequantized(variant: str, t: dict) -> torch.Tensor:
    if variant == "bf16":
        return t["w"].float()
    if variant in ("w4", "w4-mma", "w4-tile", "w8", "w8-tile"):
        q = t["qweight"] if variant.startswith("w8") else unpack_int4(t["qweight"])
        return q.float() * t["scales"].float().repeat_interleave(GROUP, 1) + t["mins"].repeat_interleave(GROUP, 1)
    if variant == "w8head":
        return t["qweight"].float() * t["scales"]
    (bn, bk), (N, K) = t["block"], t["qweight"].shape
    return t["qweight"].float() * t["scales"].repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]


def call(variant: str, x: torch.Tensor, t: dict) -> torch.Tensor:
    if variant == "bf16":
        return F.linear(x, t["w"])
    if variant in ("w4", "w8"):
        return qm.int_linear(x, t["qweight"], t["scales"], t["mins"], 4 if variant == "w4" else 8, GROUP)
    if variant == "w8head":
        return qm.int_linear(x, t["qweight"], t["scales"], None, 8, x.shape[1])
    if variant == "w4-mma":
        (M, K), N = x.shape, t["qweight"].shape[0]
        plan = qm.plan_weight_only(M, N, K, GROUP, qm.device_limits(x.device))  # no weight kind: the dot kernel
        return qm.weight_only_linear(x, t["qweight"], t["scales"], t["mins"], quant_gemm.KIND_INT4, 1, GROUP, plan)
    if variant in TILE_KINDS:
        return qm.weight_only_linear(x, t["qweight"], t["scales"], t["mins"], TILE_KINDS[variant], 1, GROUP)
    if variant == "fp8blk-mma":
        (M, K), N = x.shape, t["qweight"].shape[0]
        plan = qm.plan_weight_only(M, N, K, 128, qm.device_limits(x.device))  # no weight kind: the dot kernel
        return qm.weight_only_linear(x, t["qweight"], t["scales"], None, quant_gemm.KIND_FP8, 128, 128, plan)
    if variant == "fp8ch-tri":
        return qm.fp8_w8a8_linear(x, t["qweight"], t["scales"], 1, x.shape[1], use_scaled_mm=False)
    if variant in ("fp8blk-smm", "fp8blk-tri"):
        return qm.fp8_w8a8_linear(x, t["qweight"], t["scales"], 128, 128, use_scaled_mm=variant == "fp8blk-smm")
    if variant == "fp8blk-a16":
        return qm.weight_only_linear(x, t["qweight"], t["scales"], None, quant_gemm.KIND_FP8, 128, 128)
    return qm.fp8_linear(x, t["qweight"], t["scales"], t["block"])


def bytes_read(t: dict) -> int:
    return sum(v.numel() * v.element_size() for v in t.values() if isinstance(v, torch.Tensor))


def graph_us(fn, num_calls: int) -> float:
    """Median time per call of num_calls calls captured in one CUDA graph."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(num_calls):
            fn(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / num_calls)
    del graph
    return statistics.median(times)


def read_gbps() -> float:
    """Bytes read per second by a reduction over 1 GiB (read only): the context for the copy-based %, since a kernel
    that only reads streams faster than a copy, which also writes (bf16 cuBLAS decode reads at ~115% of copy_)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    us = graph_us(lambda i: src.amax(), 4)
    return (1 << 30) / us / 1e3


def copy_gbps() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = graph_us(lambda i: dst.copy_(src), 4)
    return 2 * (1 << 30) / us / 1e3


def rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.float() @ w.T
    return ((y.float() - ref).abs().max() / ref.abs().max()).item()


def bench_variant(name: str, variant: str, N: int, K: int, ms: list, copy_bw: float, deadline: float,
                  rows: list, errors: list):
    try:
        first = make_weights(variant, N, K)
        num_copies = max(2, min(64, math.ceil(L2_DEFEAT_BYTES / bytes_read(first))))
        copies = [first] + [make_weights(variant, N, K) for _ in range(num_copies - 1)]
    except Exception as e:  # noqa: BLE001 -- report and go on with the other variants
        errors.append(f"{name} {variant} weights: {type(e).__name__}: {e}")
        return
    for M in ms:
        if variant in LARGE_M_ONLY and M < min(W8A8_TRIAL_MIN_ROWS, qm.FP8_ACT_QUANT_MIN_ROWS):
            continue
        if variant in SMALL_M_ONLY and M > max(quant_plans.CUDA_CORE_MAX_ROWS.values()):
            continue
        if variant in TILE_KINDS and M < qm.DEQUANT_GEMM_MIN_ROWS[TILE_KINDS[variant]]:
            continue
        if time.monotonic() > deadline:
            errors.append(f"{name} {variant} M={M}: skipped, over the time budget")
            continue
        row = {"shape": name, "N": N, "K": K, "M": M, "variant": variant}
        try:
            x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
            if M in CHECK_M:
                row["max_rel_err"] = rel_err(call(variant, x, first), x, dequantized(variant, first))
            num_calls = num_copies if M <= 1024 else 2
            us = graph_us(lambda i, x=x: call(variant, x, copies[i % num_copies]), num_calls)
            row.update(us=us, gbps=bytes_read(first) / us / 1e3, tflops=2 * M * N * K / us / 1e6)
            row["pct_copy"] = 100 * row["gbps"] / copy_bw
        except Exception as e:  # noqa: BLE001
            errors.append(f"{name} {variant} M={M}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            traceback.print_exc(limit=2, file=sys.stderr)
        rows.append(row)


def _plan_call(i: int, x, copies: list, kind: int, group_n: int, plan) -> torch.Tensor:
    t = copies[i % len(copies)]
    return qm.weight_only_linear(x, t["qweight"], t["scales"], t.get("mins"), kind, group_n, GROUP, plan)


def sweep_splits(shapes: list, copy_bw: float):
    """Decode split-K: time W4 and block FP8 at 1 and 16 rows with 1..16 splits, against the plan's choice."""
    print("split-K sweep: splits, us per call (% of copy bandwidth); * = the plan's choice")
    for name in shapes:
        N, K = SHAPES[name]
        for variant, kind, group_n in (("w4", quant_gemm.KIND_INT4, 1), ("fp8blk", quant_gemm.KIND_FP8, 128)):
            first = make_weights(variant, N, K)
            num_copies = max(2, min(64, math.ceil(L2_DEFEAT_BYTES / bytes_read(first))))
            copies = [first] + [make_weights(variant, N, K) for _ in range(num_copies - 1)]
            for M in (1, 16):
                x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16)
                plan = qm.plan_weight_only(M, N, K, GROUP, qm.device_limits(x.device), kind, group_n)
                total_steps = math.ceil(K / plan.block_k)
                cells = []
                for splits in (1, 2, 4, 8, 16):
                    steps = math.ceil(total_steps / splits)
                    trial = dataclasses.replace(plan, num_splits=math.ceil(total_steps / steps), num_k_steps=steps)
                    us = graph_us(functools.partial(_plan_call, x=x, copies=copies, kind=kind, group_n=group_n,
                                                    plan=trial), num_copies)
                    mark = "*" if trial.num_splits == plan.num_splits else " "
                    pct = 100 * bytes_read(first) / us / 1e3 / copy_bw
                    cells.append(f"{trial.num_splits:>2}{mark}{us:7.1f} ({pct:3.0f}%)")
                print(f"  {name:>8} {variant:<6} M={M:<3}" + " ".join(cells))
            torch.cuda.empty_cache()


def print_table(rows: list, variants: list, copy_bw: float):
    """Two tables, decode (M <= 16) and larger M, each with the variants that ran there."""
    by_key = {(r["shape"], r["M"], r["variant"]): r for r in rows}
    print(f"copy bandwidth (1 GiB copy_, read + write): {copy_bw:.0f} GB/s; a read-only reduction over 1 GiB: "
          f"{read_gbps():.0f} GB/s")
    print("cell: us / speedup over bf16 / (M <= 16: % of copy bandwidth read; else TFLOP/s)")
    for decode in (True, False):
        group = [r for r in rows if (r["M"] <= 16) == decode]
        names = [v for v in variants if any(r["variant"] == v for r in group)]
        shapes_ms = sorted({(r["shape"], r["M"]) for r in group}, key=lambda s: (list(SHAPES).index(s[0]), s[1]))
        if not shapes_ms:
            continue
        print(f"{'shape':>8} {'M':>5} " + " ".join(f"{v:>20}" for v in names))
        for shape, M in shapes_ms:
            base = by_key.get((shape, M, "bf16"), {}).get("us")
            cells = []
            for v in names:
                r = by_key.get((shape, M, v))
                if r is None:
                    cells.append(f"{'-':>20}")
                elif "us" not in r:
                    cells.append(f"{'ERR':>20}")
                else:
                    third = f"{r['pct_copy']:.0f}%" if M <= 16 else f"{r['tflops']:.0f}T"
                    speed = f"{base / r['us']:.2f}x" if base else "?"
                    cells.append(f"{r['us']:>8.1f}/{speed:>6}/{third:>4}")
            print(f"{shape:>8} {M:>5} " + " ".join(cells))
    checked = [r for r in rows if "max_rel_err" in r]
    if checked:
        print("max |y - ref| / max |ref| against the fp32 dequantized reference:")
        for r in checked:
            print(f"  {r['shape']:>8} M={r['M']:<5} {r['variant']:<11} {r['max_rel_err']:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=DECODE_M + PREFILL_M)
    parser.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s != "head"], choices=list(SHAPES))
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--budget-s", type=float, default=160.0, help="stop timing new cells after this long")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--sweep-splits", action="store_true", help="only time decode split-K choices")
    parser.add_argument("--sweep-w4", action="store_true",
                        help="only sweep the 4-bit decode tiles (benchmarks/sweep_w4.py) within --budget-s")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference GEMM
    started = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"scaled_mm: {hasattr(torch, '_scaled_mm')}")
    copy_bw = copy_gbps()
    if args.sweep_splits:
        sweep_splits(args.shapes, copy_bw)
        return
    if args.sweep_w4:
        sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or as benchmarks.<module>
        import sweep_w4
        sweep_w4.sweep_w4(args.shapes, copy_bw, args.budget_s, args.json)
        return
    rows, errors = [], []
    for name in args.shapes:
        for variant in args.variants:
            bench_variant(name, variant, *SHAPES[name], sorted(args.m), copy_bw, started + args.budget_s, rows, errors)
            torch.cuda.empty_cache()  # the copies of this variant's weights are gone
    print_table(rows, args.variants, copy_bw)
    for line in errors:
        print("ERR", line)
    print(f"done in {time.monotonic() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"device": props.name, "copy_gbps": copy_bw, "rows": rows,
                                         "errors": errors}, indent=1))


if __name__ == "__main__":
    main()
