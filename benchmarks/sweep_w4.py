"""Sweep of the 4-bit decode tiles (nanovllm/kernels/quant_plans.W4_DECODE_TILES) on the Qwen3-8B layer shapes:

    python benchmarks/bench_quant_kernels.py --sweep-w4 [--shapes qkv o] [--budget-s 100] [--json OUT]

Each kernel the table can name is timed over a grid of DecodeTiles on every shape and at the row counts it may
serve: "gemv" (quant_gemv._int4_gemv_kernel) at 1-2 rows, "rows" (quant_gemv_rows, ROWS = M) at 2-16, "dot"
(quant_gemm._wo_gemm_kernel, 16-row tiles) and "dot_swapped" (quant_gemm_swapped, the weights the dot's first
operand) at 4-16. The grid: block_n, block_k (64 or 128, dividing G = 128), num_warps 2/4/8 (the dots 4/8),
programs per SM 2/4/8 (the K split, quant_plans.split_k) and the dots' stages 2/4, less the tiles whose per-thread
values would spill (_fits_registers): 798 configs, 166 compilations. The plan's current choice is timed first in
every cell.

Timing is bench_quant_kernels.py's: a CUDA graph cycling through weight copies of >= 256 MB (the weights come from
memory, not L2), median of 5 replays; % is the weights + scales + mins read per second as a share of copy bandwidth.
Every config's first output in each cell is checked against x @ W.T with W dequantized in fp32; one off by more
than 2^-6 of the largest output is reported ERR and cannot win.

Compilation dominates a cold run: a pool of processes compiles them first into Triton's on-disk
cache, each by one real call, so that the timing process only loads them (falls back to compiling in line).

Output: per (shape, M) the plan's %, the best config and its %, and the best of each kernel; then per M the config
with the least total time over the shapes (the table is keyed by rows, not by shape) and the W4_DECODE_TILES that
those winners make, to paste into quant_plans.py.
"""
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import math
import multiprocessing
import os
import random
import time

import torch

import bench_quant_kernels as bqk
from nanovllm.kernels import quant_gemm
from nanovllm.kernels import quant_matmul as qm
from nanovllm.kernels import quant_plans as qp
from nanovllm.kernels.quant_plans import DecodeTiles

KERNEL_MS = {"gemv": (1, 2), "rows": (2, 4, 8, 16), "dot": (4, 8, 16), "dot_swapped": (4, 8, 16)}
BLOCK_N = {"gemv": (32, 64, 128, 256), "rows": (16, 32, 64, 128), "dot": (32, 64, 128, 256),
           "dot_swapped": (64, 128, 256)}
BLOCK_K = (64, 128)
# the dot kernel's 2-warp tiles compiled to 128-255 registers a thread for sm_90a from 64 columns on (some spilled)
NUM_WARPS = {"gemv": (2, 4, 8), "rows": (2, 4, 8), "dot": (4, 8), "dot_swapped": (4, 8)}
PROGRAMS_PER_SM = (2, 4, 8)
DOT_STAGES = (2, 4)
MAX_REL_ERR = 2 ** -6  # a bf16 output is off by ~2^-8 of the largest; a wrong tile by O(1)


def _rows_per_program(kernel: str, M: int) -> int:
    return {"gemv": min(M, 2), "rows": max(2, 1 << (M - 1).bit_length()), "dot": 16, "dot_swapped": 16}[kernel]


def _fits_registers(kernel: str, M: int, block_n: int, block_k: int, num_warps: int) -> bool:
    """The CUDA-core kernels hold a tile's words twice (prefetch) and fp32 products per row: keep the words a thread
    holds 2-16 (gemv: 32 took 255 registers a thread for sm_90a) and the multi-row products <= 64 a thread, where
    the shipped tile holds 16 words and 16 products."""
    threads = 32 * num_warps
    words = block_n * block_k // 8 / threads
    if kernel == "dot":
        return block_n * block_k // 8 >= threads  # no thread without a word of the tile
    if kernel == "dot_swapped":  # a wgmma takes 64 rows a warp group; <= 128 unpacked 16-bit values a thread
        return block_n >= 16 * num_warps and block_n * block_k <= 128 * threads
    if kernel == "gemv":
        return 2 <= words <= 16
    return 1 <= words and _rows_per_program(kernel, M) * words <= 64


def candidates(kernel: str, M: int) -> list[DecodeTiles]:
    stages = DOT_STAGES if kernel.startswith("dot") else (1,)
    return [DecodeTiles(M, kernel, bn, bk, w, p, s) for bn in BLOCK_N[kernel] for bk in BLOCK_K
            for w in NUM_WARPS[kernel] for s in stages for p in PROGRAMS_PER_SM
            if _fits_registers(kernel, M, bn, bk, w)]


def label(t: DecodeTiles) -> str:
    stages = f" s{t.num_stages}" if t.kernel.startswith("dot") else ""
    return f"{t.kernel} n{t.block_n} k{t.block_k} w{t.num_warps} p{t.programs_per_sm}{stages}"


def _call(i: int, x, copies: list, plan) -> torch.Tensor:
    t = copies[i % len(copies)]
    return qm.weight_only_linear(x, t["qweight"], t["scales"], t["mins"], quant_gemm.KIND_INT4, 1, bqk.GROUP, plan)


def _plan(x: torch.Tensor, N: int, tiles: DecodeTiles):
    (M, K), limits = x.shape, qp.device_limits(x.device)
    return qp.plan_w4_decode(M, N, K, bqk.GROUP, tiles, limits)


def _compile_some(jobs: list) -> list[str]:
    """In a pool process: one call of each (kernel, M, tiles) on the o shape, so Triton caches its compilation."""
    N, K = bqk.SHAPES["o"]
    t = bqk.make_weights("w4", N, K)
    failed = []
    for M, tiles in jobs:
        try:
            x = torch.randn(M, K, device=bqk.DEVICE, dtype=torch.bfloat16)
            _call(0, x, [t], _plan(x, N, tiles))
        except Exception as e:  # noqa: BLE001 -- the timing pass reports it in its cell
            failed.append(f"{label(tiles)} M={M}: {type(e).__name__}")
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return failed


def precompile(jobs: list, num_workers: int):
    """Each distinct compilation once, spread over num_workers processes (spawned: CUDA does not survive fork)."""
    started = time.monotonic()
    distinct = {(t.kernel, _rows_per_program(t.kernel, M), t.block_n, t.block_k, t.num_warps, t.num_stages): (M, t)
                for M, t in jobs}
    work = list(distinct.values())
    chunks = [work[i::num_workers] for i in range(num_workers)]
    try:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=ctx) as pool:
            failed = [f for part in pool.map(_compile_some, chunks) for f in part]
        print(f"precompiled {len(work)} kernels in {time.monotonic() - started:.0f} s on {num_workers} processes"
              f"{'; failed: ' + ', '.join(failed[:8]) if failed else ''}", flush=True)
    except Exception as e:  # noqa: BLE001 -- the timing pass compiles in line instead
        print(f"precompile failed ({type(e).__name__}: {e}); compiling in line", flush=True)


@dataclasses.dataclass
class Shape:
    """One layer shape's weight copies (L2-defeating) and reference weight."""
    name: str
    N: int
    K: int
    copies: list
    w_ref: torch.Tensor  # fp32 [N, K], copies[0] dequantized
    num_bytes: int

    @classmethod
    def make(cls, name: str) -> "Shape":
        N, K = bqk.SHAPES[name]
        first = bqk.make_weights("w4", N, K)
        num_copies = max(2, min(64, math.ceil(bqk.L2_DEFEAT_BYTES / bqk.bytes_read(first))))
        copies = [first] + [bqk.make_weights("w4", N, K) for _ in range(num_copies - 1)]
        return cls(name, N, K, copies, bqk.dequantized("w4", first), bqk.bytes_read(first))


def time_cell(shape: Shape, M: int, x: torch.Tensor, ref: torch.Tensor, tiles: DecodeTiles, copy_bw: float) -> dict:
    row = {"shape": shape.name, "M": M, "label": label(tiles), **dataclasses.asdict(tiles)}
    try:
        plan = _plan(x, shape.N, tiles)
        row["splits"] = plan.num_splits
        y = _call(0, x, shape.copies, plan).float()
        row["rel_err"] = ((y - ref).abs().max() / ref.abs().max()).item()
        if not row["rel_err"] <= MAX_REL_ERR:
            row["error"] = f"wrong result: rel err {row['rel_err']:.2e}"
            return row
        row["us"] = bqk.graph_us(functools.partial(_call, x=x, copies=shape.copies, plan=plan), len(shape.copies))
        row["pct"] = 100 * shape.num_bytes / row["us"] / 1e3 / copy_bw
    except Exception as e:  # noqa: BLE001 -- a config that fails to compile or launch loses, the others go on
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return row


def sweep_w4(shape_names: list, copy_bw: float, budget_s: float, json_path=None):
    started = time.monotonic()
    # round robin over (kernel, M), each group in a fixed shuffled order: a sweep cut short by its budget has tried
    # every kernel at every M, on a sample spread over the grid
    groups = [[(M, t) for t in candidates(kernel, M)] for kernel, ms in KERNEL_MS.items() for M in ms]
    for group in groups:
        random.Random(0).shuffle(group)
    jobs = [job for batch in itertools.zip_longest(*groups) for job in batch if job is not None]
    print(f"W4 decode sweep: {len(jobs)} configs x {len(shape_names)} shapes, budget {budget_s:.0f} s; copy "
          f"bandwidth {copy_bw:.0f} GB/s", flush=True)
    precompile(jobs, max(1, min(12, (os.cpu_count() or 2) - 2)))
    shapes = [Shape.make(name) for name in shape_names]
    cells = {}  # (shape, M) -> (x, ref)
    for shape in shapes:
        for M in sorted({M for ms in KERNEL_MS.values() for M in ms}):
            x = torch.randn(M, shape.K, device=bqk.DEVICE, dtype=torch.bfloat16)
            cells[shape.name, M] = (x, x.float() @ shape.w_ref.T)
    rows, skipped = [], 0
    current = {M: qp.w4_decode_tiles(M) for M in {M for _, M in cells}}
    for shape in shapes:  # the plan's choice first, so that a cut-short sweep still has every baseline
        for M, tiles in sorted(current.items()):
            rows.append(dict(time_cell(shape, M, *cells[shape.name, M], tiles, copy_bw), current=True))
    for M, tiles in jobs:
        for shape in shapes:
            if time.monotonic() - started > budget_s:
                skipped += 1
                continue
            rows.append(time_cell(shape, M, *cells[shape.name, M], tiles, copy_bw))
    print(f"timed {len(rows)} cells in {time.monotonic() - started:.0f} s; {skipped} skipped over the budget")
    report(rows, shape_names, current)
    if json_path:
        json_path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": copy_bw,
                                         "rows": rows}, indent=0))


def _best(rows: list) -> dict | None:
    timed = [r for r in rows if "us" in r]
    return min(timed, key=lambda r: r["us"]) if timed else None


def report(rows: list, shape_names: list, current: dict):
    """Per (shape, M) the plan's and the best configs; per M the least total time over the shapes; the table."""
    print("\nper cell: plan = the current table's choice; best overall; best of each kernel (% of copy bandwidth)")
    for name in shape_names:
        for M in sorted(current):
            cell = [r for r in rows if r["shape"] == name and r["M"] == M]
            plan = next((r for r in cell if r.get("current")), {})
            best = _best(cell)
            per_kernel = "  ".join(f"{k} {b['pct']:3.0f}%" for k in KERNEL_MS
                                   if (b := _best([r for r in cell if r["kernel"] == k])))
            plan_pct = f"{plan['pct']:3.0f}%" if "pct" in plan else "ERR"
            best_text = f"{best['pct']:3.0f}% {best['us']:7.1f} us {best['label']}" if best else "none"
            print(f"{name:>8} M={M:<3} plan {plan_pct} | best {best_text} | {per_kernel}")
    print("\nper M, the config with the least total time over the shapes (all shapes timed):")
    winners = {}
    for M in sorted(current):
        totals = {}  # label -> shape -> the faster of its timings (the plan's config is timed twice when in the grid)
        for r in rows:
            if r["M"] == M and "us" in r:
                by_shape = totals.setdefault(r["label"], {})
                by_shape[r["shape"]] = min(by_shape.get(r["shape"], r), r, key=lambda row: row["us"])
        complete = {k: list(v.values()) for k, v in totals.items() if len(v) == len(shape_names)}
        plan_total = sum(r["us"] for r in rows if r["M"] == M and r.get("current") and "us" in r)
        if not complete:
            print(f"  M={M:<3} no config timed on every shape")
            continue
        best_label = min(complete, key=lambda k: sum(r["us"] for r in complete[k]))
        best_total = sum(r["us"] for r in complete[best_label])
        winners[M] = complete[best_label][0]
        print(f"  M={M:<3} {best_label:<28} {best_total:8.1f} us total, plan {plan_total:8.1f} us "
              f"({plan_total / best_total:.2f}x)")
    print_table(winners)
    failed = [r for r in rows if "error" in r]
    for r in failed[:20]:
        print(f"ERR {r['shape']} M={r['M']} {r['label']}: {r['error']}")
    if len(failed) > 20:
        print(f"ERR ... and {len(failed) - 20} more")


def print_table(winners: dict):
    """The winners as W4_DECODE_TILES: each winner covers the rows above the previous measured M up to its own."""
    entries = []
    for M, r in sorted(winners.items()):
        tiles = DecodeTiles(M, r["kernel"], r["block_n"], r["block_k"], r["num_warps"], r["programs_per_sm"],
                            r["num_stages"])
        if entries and dataclasses.replace(entries[-1], max_rows=M) == tiles:
            entries[-1] = tiles  # the same config as the entry below: one range
        else:
            entries.append(tiles)
    print("\nW4_DECODE_TILES = (  # paste into nanovllm/kernels/quant_plans.py")
    for t in entries:
        stages = f", num_stages={t.num_stages}" if t.kernel.startswith("dot") else ""
        print(f"    DecodeTiles(max_rows={t.max_rows}, kernel={t.kernel!r}, block_n={t.block_n}, "
              f"block_k={t.block_k}, num_warps={t.num_warps}, programs_per_sm={t.programs_per_sm}{stages}),")
    print(")")
