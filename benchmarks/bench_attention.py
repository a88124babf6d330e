"""Microbenchmark of the Triton paged-attention kernels.

    python benchmarks/bench_attention.py [--sweep [decode] [prefill]] [--overlap] [--prefill]
    python benchmarks/bench_attention.py --sustained [ROWS ...]
    python benchmarks/bench_attention.py --kv-cache-dtype auto fp8 [--rows 1024 256] [--layers 8]
    python benchmarks/bench_attention.py --kv-cache-dtype auto fp8 --heads 16 8 --context 1000 7000 --rows 20 40 \
        --splits 1 4 16 32 --min-split-tokens 256     # the laptop's regime (Qwen3-1.7B heads, long rows)

Prints, for decode at batch 256 / context 1024 (Qwen3-0.6B and Qwen3-8B head shapes, bf16,
block_size 256): kernel time, GB/s of KV read, the device-to-device copy bandwidth measured in the
same run (read + write bytes of a large ``dst.copy_(src)``) and the ratio of the two, and a read-only
bandwidth (the best streaming-read Triton kernel over 4 GiB); the same at batch 128 / block_size 64 (the engine's
default). Then prefill attention on a 16k-token batch, with torch SDPA (flash) on contiguous tensors as a
yardstick, and on a step of bench.py's prompts.
``--sweep`` also times a grid of decode (tile configs x split counts) and prefill tile configs.
``--prefill`` times only the prefill tiles (the sweep's grid) on the engine's prefill shapes at block size 64: a
bench.py prefill step (Qwen3-8B and Qwen3-0.6B heads), 29 prompts of 560 tokens, and 8 chunks of 1,000 tokens after
2,000 cached ones.
``--sustained`` holds Qwen3-8B decode layers at the power limit (attention alone in several tiles, the GEMMs alone,
the two interleaved, a plain streaming read of the same cache) with board power and SM clock from NVML.
``--overlap`` times only whether decode attention (memory-bound) and a layer's GEMMs (compute-bound) run faster
side by side on two CUDA streams than one after the other (Qwen3-8B shapes): the premise of nano-batches.
``--kv-cache-dtype auto fp8`` times only decode attention at the 8B shape reading a bf16 cache against an FP8 cache
(values + per-token scales), KV bytes read (scales counted) against the copy bandwidth; ``--heads`` and ``--context``
change the shape and the rows' lengths, ``--fp8-tiles``, ``--splits`` and ``--min-split-tokens`` add runs at other
tiles, split counts and shortest slices.
"""

import argparse
import dataclasses
import math
import random
import time

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from nanovllm.kernels.decode_attention import (
    SPLIT_PLAN_BLOCK_N,
    decode_config,
    decode_split_plan,
    paged_decode_attention,
    sm_count,
)
from nanovllm.kernels.paged_common import KernelConfig
from nanovllm.kernels.prefill_attention import paged_prefill_attention
from nanovllm.layers.kv_layout import KVLayout, quantize_fp8

SHAPES = {  # name: (q heads, kv heads, head_dim)
    "Qwen3-0.6B": (16, 8, 128),
    "Qwen3-8B": (32, 8, 128),
}
NUM_LAYERS = 2  # > 1 so the layer view is strided like in the engine
# prefill tiles the sweep times: (block_m, block_n, num_warps, num_stages); (64, 64, 4, 3) is the default
PREFILL_TILES = [KernelConfig(m, n, w, st) for (m, n, w, st) in (
    (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 4, 2), (128, 32, 4, 3), (128, 32, 4, 4), (128, 128, 8, 2),
    (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (64, 32, 4, 3), (64, 128, 4, 2), (256, 64, 8, 2),
    (256, 32, 8, 3))]


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, num_per_program, BLOCK: tl.constexpr):
    """Sums one contiguous slice of x: a pure streaming read, one float written per program."""
    base = tl.program_id(0).to(tl.int64) * num_per_program
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, num_per_program, BLOCK):
        acc += tl.load(x_ptr + base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def read_bandwidth(nbytes: int = 4 << 30) -> tuple[float, str]:
    """Read-only bandwidth in bytes/s, the best of a few streaming-read kernels over a large bf16 tensor (the
    ceiling a decode kernel, which only reads KV, could reach), and that kernel's config."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    best = (0.0, "")
    for num_programs in (1056, 4224, 16896):  # 8, 32, 128 per SM on an H200
        per_program = src.numel() // num_programs
        for block, warps in ((1024, 4), (2048, 4), (4096, 8)):
            per_program -= per_program % block
            out = torch.empty(num_programs, dtype=torch.float32, device="cuda")
            ms = bench_ms(lambda: _stream_read_kernel[(num_programs,)](src, out, per_program, BLOCK=block,
                                                                        num_warps=warps))
            best = max(best, (num_programs * per_program * 2 / (ms * 1e-3),
                              f"{num_programs} programs, block {block}, {warps} warps"))
    del src
    torch.cuda.empty_cache()
    return best


def make_paged_cache(batch, ctx, num_kv_heads, head_dim, block_size, dtype, copies=1):
    """Cache views of kv[N, L, 2, bs, H, D] (layer 0) and a permuted block table [B, width] (with `copies`: that
    many tables [copies, B, width], on disjoint blocks)."""
    width = math.ceil(ctx / block_size)
    num_blocks = copies * batch * width
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda").view(copies, batch, width).to(torch.int32)
    return kv, kv[:, 0, 0], kv[:, 0, 1], tables if copies > 1 else tables[0]


# A timed decode graph reads at least this much KV, more than the L2 cache holds (50 MB on an H200).
_GRAPH_KV_BYTES = 256 << 20


class DecodeCase:
    """Inputs of one decode-attention measurement. `ragged`: context lengths uniform in [100, 2 * ctx - 100] (mean
    ctx) instead of all ctx, as in a run; `table_ctx`: block tables this many tokens wide (padded), as the engine's
    decode graphs pass them (max_model_len wide).

    Timed as the engine runs it, in CUDA-graph replays: launched one by one from Python, a small batch's kernel
    time is the launch overhead (~0.1 ms for kernel, reduce and scratch). A graph holds one call per copy of the
    block tables, each copy on its own blocks, so that together they read more than the L2 cache holds."""

    def __init__(self, name, batch, ctx, block_size, dtype=torch.bfloat16, ragged=False, table_ctx=None):
        num_heads, self.num_kv_heads, self.head_dim = SHAPES[name]
        self.batch, self.block_size, self.dtype = batch, block_size, dtype
        max_ctx = 2 * ctx - 100 if ragged else ctx
        rng = random.Random(0)
        lens = [rng.randint(100, max_ctx) if ragged else ctx for _ in range(batch)]
        self.kv_bytes = sum(lens) * self.num_kv_heads * self.head_dim * 2 * dtype.itemsize
        copies = math.ceil(_GRAPH_KV_BYTES / self.kv_bytes)
        self.kv, self.k_cache, self.v_cache, tables = make_paged_cache(batch, max_ctx, self.num_kv_heads,
                                                                       self.head_dim, block_size, dtype, copies)
        tables = tables.view(copies, batch, -1)
        if table_ctx is not None:
            tables = torch.nn.functional.pad(tables, (0, math.ceil(table_ctx / block_size) - tables.shape[2]))
        self.tables = list(tables.unbind(0))  # one [B, width] table per copy
        self.q = torch.randn(batch, num_heads, self.head_dim, dtype=dtype, device="cuda")  # [B, H, D]
        self.lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        self.longest_first = torch.argsort(self.lens, descending=True).to(torch.int32)
        self.out = torch.empty_like(self.q)
        self.label = (f"decode {name:11s} B={batch:3d} ctx={ctx:5d}{' (ragged)' if ragged else ''} "
                      f"bs={block_size:3d}{f' table {table_ctx} tokens wide' if table_ctx else ''}")

    def split_plan(self) -> int:
        return decode_split_plan(self.batch, self.num_kv_heads, self.tables[0].shape[1], self.block_size,
                                 SPLIT_PLAN_BLOCK_N, sm_count(self.q.device))

    def run(self, cfg=None, splits=None) -> tuple[float, float]:
        """(ms of one call, KV bytes read per second), from replays of a graph of one call per table copy."""
        def calls():
            for tables in self.tables:
                paged_decode_attention(self.q, self.k_cache, self.v_cache, self.lens, tables, self.head_dim ** -0.5,
                                       out=self.out, num_splits=splits, config=cfg, row_order=self.longest_first)
        calls()  # compiles outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            calls()
        ms = bench_ms(graph.replay) / len(self.tables)
        del graph
        return ms, self.kv_bytes / (ms * 1e-3)

    def free(self):
        del self.kv, self.k_cache, self.v_cache, self.tables
        torch.cuda.empty_cache()


def bench_decode(name, batch, ctx, block_size, copy_bw, dtype=torch.bfloat16, sweep=False, other_splits=(),
                 ragged=False):
    """The default kernel, then other split counts and a sweep of tiles."""
    case = DecodeCase(name, batch, ctx, block_size, dtype, ragged)
    splits = case.split_plan()
    ms, bw = case.run()
    print(f"{case.label} splits={splits:2d}: "
          f"{ms * 1e3:8.1f} us  KV read {bw / 1e9:7.0f} GB/s  = {bw / copy_bw:6.1%} of copy bw", flush=True)
    for s in other_splits:
        ms, bw = case.run(None, s)
        print(f"    splits={s:2d}: {ms * 1e3:8.1f} us  {bw / 1e9:7.0f} GB/s  {bw / copy_bw:6.1%}", flush=True)
    if sweep:
        configs = [KernelConfig(16, bn, w, st) for bn in (32, 64, 128) for (w, st) in ((4, 2), (4, 3), (8, 3))]
        configs += [KernelConfig(16, 32, 4, 4), KernelConfig(16, 64, 4, 4), KernelConfig(16, 64, 2, 3)]
        runs = [(c, 1) for c in configs] + [(c, 2) for c in configs]
        for c, s in runs:
            try:
                ms, bw = case.run(c, s)
                print(f"    sweep bn={c.block_n:3d} warps={c.num_warps} stages={c.num_stages} splits={s}: "
                      f"{ms * 1e3:8.1f} us  {bw / 1e9:6.0f} GB/s  {bw / copy_bw:6.1%}", flush=True)
            except Exception as e:  # e.g. out of shared memory
                print(f"    sweep {c} splits={s}: failed ({type(e).__name__})", flush=True)
    case.free()


def bench_wide_tables(batch, table_ctx, copy_bw, name="Qwen3-0.6B", ctx=1024, block_size=64):
    """Ragged contexts in tables `table_ctx` tokens wide, as the engine's decode graphs pass them (max_model_len
    wide): each row cuts its own context into the splits, so a short row in a wide table still splits."""
    case = DecodeCase(name, batch, ctx, block_size, ragged=True, table_ctx=table_ctx)
    ms, bw = case.run()
    print(f"{case.label} splits={case.split_plan():2d}: {ms * 1e3:6.1f} us {bw / copy_bw:6.1%} of copy bw", flush=True)
    case.free()


def bench_prefill(name, seqs, block_size=256, dtype=torch.bfloat16, sweep=False):
    """`seqs`: list of (cached prefix, new tokens)."""
    num_heads, num_kv_heads, head_dim = SHAPES[name]
    seq_lens = [p + n for p, n in seqs]
    qlens = [n for _, n in seqs]
    width = max(math.ceil(n / block_size) for n in seq_lens)
    num_blocks = len(seqs) * width
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    k_cache, v_cache = kv[:, 0, 0], kv[:, 0, 1]
    tables = torch.randperm(num_blocks, device="cuda").view(len(seqs), width).to(torch.int32)
    q = torch.randn(sum(qlens), num_heads, head_dim, dtype=dtype, device="cuda")  # [T, H, D]
    cu = torch.tensor([0] + [sum(qlens[:i + 1]) for i in range(len(qlens))], dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    scale = head_dim ** -0.5
    ms = bench_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max(qlens), scale))
    # causal FLOPs: 2 matmuls x 2 flop/MAC x visible (q, k) pairs x D x H
    pairs = sum(n * p + n * (n + 1) // 2 for p, n in seqs)
    tflops = 4 * pairs * head_dim * num_heads / (ms * 1e-3) / 1e12
    desc = f"{len(seqs)}x(prefix {seqs[0][0]}, new {seqs[0][1]})" if len(set(seqs)) == 1 else f"{len(seqs)} seqs"
    line = f"prefill {name:11s} {sum(qlens):6d} tokens [{desc}]: {ms * 1e3:8.1f} us  {tflops:6.1f} TFLOP/s"

    if all(p == 0 for p, _ in seqs) and len(set(qlens)) == 1:
        # yardstick: torch SDPA on contiguous [B, H, L, D] tensors (no paging)
        b, n = len(seqs), qlens[0]
        qs = torch.randn(b, num_heads, n, head_dim, dtype=dtype, device="cuda")
        ks = torch.randn(b, num_heads, n, head_dim, dtype=dtype, device="cuda")
        vs = torch.randn_like(ks)
        sdpa = bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))
        line += f"   (torch SDPA, contiguous: {sdpa * 1e3:8.1f} us)"
    print(line, flush=True)
    if sweep:
        default_out = paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max(qlens), scale)
        for c in PREFILL_TILES:
            try:
                out = paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max(qlens), scale, config=c)
                diff = (out.float() - default_out.float()).abs().max().item()  # tiles sum in other orders
                ms = bench_ms(lambda: paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max(qlens),
                                                              scale, config=c))
                tflops = 4 * pairs * head_dim * num_heads / (ms * 1e-3) / 1e12
                print(f"    sweep m={c.block_m:3d} n={c.block_n:3d} warps={c.num_warps} stages={c.num_stages}: "
                      f"{ms * 1e3:8.1f} us  {tflops:6.1f} TFLOP/s  (max |diff| to the default tile {diff:.2g})",
                      flush=True)
            except Exception as e:  # e.g. out of shared memory
                print(f"    sweep {c}: failed ({type(e).__name__})", flush=True)
    del kv
    torch.cuda.empty_cache()


def _green_streams(*num_sms: int):
    """((contexts), (one stream per context)) for CUDA green contexts of these SM counts, or (None, why)."""
    try:
        from torch.cuda.green_contexts import GreenContext
        contexts = tuple(GreenContext.create(num_sms=n, device_id=torch.cuda.current_device()) for n in num_sms)
        return (contexts, tuple(c.Stream() for c in contexts)), ""
    except Exception as e:  # an older torch (no Stream()), a driver without green contexts, a bad SM count
        return None, f"{type(e).__name__}: {e}"


def _graph_replay_us(fn, repeats: int) -> str:
    """fn captured in a CUDA graph, replayed: us per repeat, or why the capture failed."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        end.synchronize()
        return f"{start.elapsed_time(end) / 3 / repeats * 1e3:.1f} us"
    except Exception as e:  # e.g. a capture across contexts refused
        return f"failed ({type(e).__name__}: {str(e)[:200]})"


def bench_overlap(batch: int = 288, ctx: int = 1024, repeats: int = 20):
    """Qwen3-8B decode at `batch` rows (half of bench.py's 8B batch): one layer's attention over ragged contexts,
    and one layer's GEMMs (qkv, o, gate_up, down), each `repeats` times, one after the other and then on two
    streams at once. Overlap = (serial - concurrent) / min(attention, GEMMs): 0 is none, 1 is perfect. Then with
    the SMs split between the two streams (CUDA green contexts, where torch has them)."""
    num_heads, num_kv_heads, head_dim = SHAPES["Qwen3-8B"]
    hidden, inter, dtype = 4096, 12288, torch.bfloat16
    kv, k_cache, v_cache, tables = make_paged_cache(batch, 2 * ctx - 100, num_kv_heads, head_dim, 64, dtype)
    rng = random.Random(0)
    lens = torch.tensor([rng.randint(100, 2 * ctx - 100) for _ in range(batch)], dtype=torch.int32, device="cuda")
    order = torch.argsort(lens, descending=True).to(torch.int32)  # the engine sorts once per forward
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    x = torch.randn(batch, hidden, dtype=dtype, device="cuda")
    weights = [torch.randn(n, k, dtype=dtype, device="cuda") * 0.02 for n, k in
               (((num_heads + 2 * num_kv_heads) * head_dim, hidden), (hidden, num_heads * head_dim),
                (2 * inter, hidden), (hidden, inter))]
    acts = [x, torch.randn(batch, num_heads * head_dim, dtype=dtype, device="cuda"), x,
            torch.randn(batch, inter, dtype=dtype, device="cuda")]

    def attention():
        for _ in range(repeats):
            paged_decode_attention(q, k_cache, v_cache, lens, tables, head_dim ** -0.5, out=out, row_order=order)

    def gemms():
        for _ in range(repeats):
            for a, w in zip(acts, weights):
                torch.nn.functional.linear(a, w)

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    streams = {"equal priority": (torch.cuda.Stream(), torch.cuda.Stream()),
               "attention stream high priority": (torch.cuda.Stream(priority=-1), torch.cuda.Stream())}

    def concurrent(s_attn, s_gemm):
        main = torch.cuda.current_stream()
        s_attn.wait_stream(main)
        s_gemm.wait_stream(main)
        with torch.cuda.stream(s_attn):
            attention()
        with torch.cuda.stream(s_gemm):
            gemms()
        main.wait_stream(s_attn)
        main.wait_stream(s_gemm)

    t_attn, t_gemm = timed(attention), timed(gemms)
    t_serial = timed(lambda: (attention(), gemms()))
    print(f"overlap, Qwen3-8B decode B={batch} ragged ctx (mean {ctx}), per layer: attention {t_attn * 1e3:.1f} us, "
          f"GEMMs {t_gemm * 1e3:.1f} us, one after the other {t_serial * 1e3:.1f} us", flush=True)
    for name, pair in streams.items():
        t = timed(lambda: concurrent(*pair))
        print(f"    two streams, {name}: {t * 1e3:.1f} us  overlap {(t_serial - t) / min(t_attn, t_gemm):.0%}",
              flush=True)
    print(f"    one after the other, captured in one CUDA graph: "
          f"{_graph_replay_us(lambda: (attention(), gemms()), repeats)}; two streams, captured: "
          f"{_graph_replay_us(lambda: concurrent(*streams['equal priority']), repeats)}", flush=True)
    # SM partitions: attention's stream on num_sms SMs, the GEMMs' on the rest (CUDA green contexts; two separate
    # create() calls are not promised disjoint SMs, so the alone-times below say what each really got)
    total_sms = sm_count(q.device)
    for num_sms in (32, 48, 64, 80):
        pair, why = _green_streams(num_sms, total_sms - num_sms)
        if pair is None:
            print(f"    green contexts of {num_sms} + {total_sms - num_sms} SMs: not available ({why})", flush=True)
            continue
        s_attn, s_gemm = pair[1]
        with torch.cuda.stream(s_attn):
            t_a = timed(attention)
        with torch.cuda.stream(s_gemm):
            t_g = timed(gemms)
        t = timed(lambda: concurrent(s_attn, s_gemm))
        print(f"    green contexts, attention on {num_sms} SMs ({t_a * 1e3:.1f} us alone), GEMMs on "
              f"{total_sms - num_sms} ({t_g * 1e3:.1f} us alone): {t * 1e3:.1f} us together, "
              f"{t_serial / t:.2f}x one after the other on all SMs", flush=True)
        if num_sms == 64:  # the engine's decode steps replay CUDA graphs: does a capture keep the partition?
            print(f"        the same captured in one CUDA graph: "
                  f"{_graph_replay_us(lambda: concurrent(s_attn, s_gemm), repeats)}", flush=True)
    del kv, k_cache, v_cache
    torch.cuda.empty_cache()


def _held(fn, seconds: float, per: int) -> tuple[float, str]:
    """fn captured in a CUDA graph and replayed for `seconds`: (us per 1/`per` of a replay, board power and SM clock
    over the second half)."""
    from bench_gemm import hold  # the script beside this one
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms, power = hold(graph.replay, seconds, repeats=5)
    del graph
    time.sleep(0.5)  # let the board cool between cases
    return ms / per * 1e3, power


def _held_stream_read(x: torch.Tensor, seconds: float) -> str:
    """A plain streaming read of all of `x` (bf16), repeated for `seconds`: GB/s, power and clock."""
    flat = x.view(-1)
    num_programs, block = 4224, 2048
    per_program = flat.numel() // num_programs // block * block
    partial = torch.empty(num_programs, dtype=torch.float32, device="cuda")
    us, power = _held(lambda: _stream_read_kernel[(num_programs,)](flat, partial, per_program, BLOCK=block,
                                                                     num_warps=4), seconds, 1)
    return f"{num_programs * per_program * 2 / us / 1e3:6.0f} GB/s  {power}"


def sustained_decode(batch: int = 1024, mean_ctx: int = 574, num_layers: int = 8, seconds: float = 2.0):
    """Qwen3-8B decode layers held at the power limit: `batch` rows of ragged contexts (uniform in
    [100, 2 * mean_ctx - 100]; 574 is the 8B run's first decode step), block size 64, `num_layers` layers of their own
    KV and weights (more than the L2 cache holds), each case replayed from a CUDA graph for `seconds` with board
    power and SM clock sampled. Cases: the four GEMMs alone; decode attention alone and interleaved with the GEMMs
    as a decode step runs them, in several tiles and on a head-major view of the cache; a plain streaming read of
    the cache; and attention again on an all-zero cache.

    Why: an 8B run is held at the 700 W limit (docs/benchmarks.md), and the limiter sets one SM clock
    for a whole step. A tile that reads KV as fast but draws less power could leave the GEMMs beside it a higher
    clock: only the interleaved case shows that. The streaming read and the zero cache say how much of attention's
    power is the memory side's and the data's."""
    num_heads, num_kv_heads, head_dim = SHAPES["Qwen3-8B"]
    hidden, inter, dtype, block_size = 4096, 12288, torch.bfloat16, 64
    rng = random.Random(0)
    max_ctx = 2 * mean_ctx - 100
    lens_list = [rng.randint(100, max_ctx) for _ in range(batch)]
    width = math.ceil(max_ctx / block_size)
    kv = torch.randn(batch * width, num_layers, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    # the same bytes with each block's kv heads apart: a head's 64 tokens contiguous (16 KB) instead of 64 rows of
    # 256 B, 2 KB apart (the engine's token-major layout)
    head_major = kv.view(kv.shape[0], num_layers, 2, num_kv_heads, block_size, head_dim).permute(0, 1, 2, 4, 3, 5)
    tables = torch.randperm(batch * width, device="cuda").view(batch, width).to(torch.int32)
    lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    order = torch.argsort(lens, descending=True).to(torch.int32)  # the engine sorts once per forward
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device="cuda")
    out = torch.empty_like(q)
    gemm_shapes = (((num_heads + 2 * num_kv_heads) * head_dim, hidden), (hidden, num_heads * head_dim),
                   (2 * inter, hidden), (hidden, inter))
    weights = [[torch.randn(n, k, dtype=dtype, device="cuda") * 0.02 for n, k in gemm_shapes]
               for _ in range(num_layers)]
    acts = [torch.randn(batch, k, dtype=dtype, device="cuda") for _, k in gemm_shapes]
    outs = [torch.empty(batch, n, dtype=dtype, device="cuda") for n, _ in gemm_shapes]
    kv_bytes = sum(lens_list) * num_kv_heads * head_dim * 2 * dtype.itemsize  # one layer's K and V
    flops = 2 * batch * sum(n * k for n, k in gemm_shapes)

    def attention(cache, layer, cfg):
        paged_decode_attention(q, cache[:, layer, 0], cache[:, layer, 1], lens, tables, head_dim ** -0.5, out=out,
                               config=cfg, row_order=order)

    def gemms(layer):
        for a, w, o in zip(acts, weights[layer], outs):
            torch.matmul(a, w.t(), out=o)

    def attention_case(name, cache, cfg):
        us_a, power_a = _held(lambda: [attention(cache, layer, cfg) for layer in range(num_layers)], seconds,
                              num_layers)
        us_l, power_l = _held(lambda: [(attention(cache, layer, cfg), gemms(layer)) for layer in range(num_layers)],
                              seconds, num_layers)
        print(f"{name}, tile ({cfg.block_n}, {cfg.num_warps} warps, {cfg.num_stages} stages): attention alone "
              f"{us_a:7.1f} us/layer {kv_bytes / us_a / 1e3:6.0f} GB/s  {power_a} | interleaved with the GEMMs "
              f"{us_l:7.1f} us/layer  {power_l}", flush=True)

    print(f"## sustained Qwen3-8B decode, {batch} rows, ragged contexts (mean {mean_ctx}), block 64, {num_layers} "
          f"layers, {seconds} s a case; KV {kv_bytes / 1e9:.2f} GB and GEMMs {flops / 1e12:.2f} TFLOP a layer",
          flush=True)
    us, power = _held(lambda: [gemms(layer) for layer in range(num_layers)], seconds, num_layers)
    print(f"GEMMs alone: {us:7.1f} us/layer {flops / us / 1e6:6.1f} TFLOP/s  {power}", flush=True)
    default = decode_config(dtype, head_dim, block_size, False)
    tiles = [default] + [dataclasses.replace(default, block_n=n, num_warps=w, num_stages=st)
                         for n, w, st in ((64, 2, 2), (64, 2, 3), (32, 2, 3), (32, 4, 2))
                         if (n, w, st) != (default.block_n, default.num_warps, default.num_stages)]
    for cfg in tiles:
        try:
            attention_case("token-major blocks", kv, cfg)
        except Exception as e:  # noqa: BLE001 -- e.g. out of shared memory
            print(f"tile {cfg}: failed ({type(e).__name__})", flush=True)
    attention_case("head-major blocks", head_major, default)
    print(f"streaming read of the same cache, random: {_held_stream_read(kv, seconds)}", flush=True)
    kv.zero_()
    print(f"streaming read of the same cache, all zero: {_held_stream_read(kv, seconds)}", flush=True)
    attention_case("all-zero KV", kv, default)
    del kv, head_major
    torch.cuda.empty_cache()

def time_kv_cache_dtype(kv_cache_dtype: str, lens: list[int], num_layers: int, block_size: int = 64,
                        num_kv_heads: int = 8, num_heads: int = 32, head_dim: int = 128,
                        config: KernelConfig | None = None, num_splits: int | None = None,
                        min_split_tokens: int | None = None) -> tuple[float, float]:
    """(seconds a layer, KV bytes read per second) of decode attention over `num_layers` layer views of one
    block-major cache in `kv_cache_dtype` ("auto": bf16; "fp8": values + per-token scales), so each layer's K/V is a
    strided view as in the engine; timed in replays of a graph of one call per layer. FP8 bytes count the scales."""
    rows = len(lens)
    layout = KVLayout(num_layers, block_size, num_kv_heads, head_dim, torch.bfloat16, kv_cache_dtype)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 1
    kv = layout.allocate(num_blocks, torch.device("cuda"))
    if layout.is_fp8:  # realistic bytes: quantized random K/V
        for layer in range(num_layers):
            views = layout.layer_views(kv, layer)
            for part in ("k", "v"):
                values, scales = quantize_fp8(torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                                                          device="cuda"), layout.dtype)
                getattr(views, part).copy_(values)
                getattr(views, part + "_scale").copy_(scales)
    else:
        kv.normal_()
    perm = torch.randperm(num_blocks - 1).tolist()
    tables = torch.full((rows, max(widths)), -1, dtype=torch.int32)
    start = 0
    for i, w in enumerate(widths):
        tables[i, :w] = torch.tensor(perm[start:start + w])
        start += w
    tables, seq_lens = tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(rows, num_heads, head_dim, dtype=torch.bfloat16, device="cuda")  # [B, H, D]
    out = torch.empty_like(q)
    order = torch.argsort(seq_lens, descending=True).to(torch.int32)  # the engine sorts once per forward
    views = [layout.layer_views(kv, i) for i in range(num_layers)]

    def step():
        for v in views:
            paged_decode_attention(q, v.k, v.v, seq_lens, tables, head_dim ** -0.5, out=out, row_order=order,
                                   k_scale=v.k_scale, v_scale=v.v_scale, config=config, num_splits=num_splits,
                                   min_split_tokens=min_split_tokens)
    step()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seconds = bench_ms(graph.replay) * 1e-3
    bytes_per_token_head = head_dim * 2 if not layout.is_fp8 else head_dim + 2  # FP8 values + a bf16 scale
    kv_bytes = sum(lens) * num_kv_heads * 2 * bytes_per_token_head * num_layers
    del graph, kv
    torch.cuda.empty_cache()
    return seconds / num_layers, kv_bytes / seconds


def parse_fp8_tile(tile: str) -> KernelConfig:
    """"BLOCK_N,WARPS,STAGES[,MAX_REGISTERS][,halves]": a decode tile; "halves" takes head_dim in two halves."""
    parts = tile.split(",")
    halves = parts[-1] == "halves"
    numbers = [int(x) for x in parts if x != "halves"]
    block_n, num_warps, num_stages = numbers[:3]
    max_registers = numbers[3] if len(numbers) > 3 else None
    return KernelConfig(16, block_n, num_warps, num_stages, max_registers, fp8_d_halves=halves)


def bench_kv_cache_dtypes(kv_cache_dtypes: list[str], rows_list: list[int], num_layers: int, copy_bw: float,
                          fp8_tiles: list[str], context: tuple[int, int] = (100, 1048),
                          heads: tuple[int, int] = (32, 8), splits_list: list[int] | None = None,
                          min_split_tokens_list: list[int] | None = None):
    """--kv-cache-dtype: decode attention reading a cache in each dtype, by default at the Qwen3-8B shape with
    ragged contexts as in the 8B bench.py run's first decode step; with --fp8-tiles also the FP8 cache in other
    decode tiles, with --splits each of them also at these split counts instead of the plan's (and with
    --min-split-tokens at each of these shortest slices too)."""
    num_heads, num_kv_heads = heads
    for rows in rows_list:
        rng = random.Random(0)
        lens = [rng.randint(*context) for _ in range(rows)]
        # each dtype in its default tile and FP8 in each given tile, each at the plan's split count and at each
        # given one, that with each given shortest slice
        mins = [None] + (min_split_tokens_list or [])
        split_runs = [(None, None)] + [(n, m) for n in splits_list or [] for m in mins]
        runs = [(dtype, tile, n, m) for n, m in split_runs
                for dtype, tile in [(d, None) for d in kv_cache_dtypes] + [("fp8", t) for t in fp8_tiles]]
        for dtype, tile, splits, min_tokens in runs:
            config = None if tile is None else parse_fp8_tile(tile)
            per_layer, rate = time_kv_cache_dtype(dtype, lens, num_layers, num_kv_heads=num_kv_heads,
                                                  num_heads=num_heads, config=config, num_splits=splits,
                                                  min_split_tokens=min_tokens)
            print(f"rows {rows} kv {dtype:5s}{f' tile {tile}' if tile else ''}"
                  f"{f' splits {splits}' if splits else ''}{f' min {min_tokens}' if min_tokens else ''}: "
                  f"{per_layer * 1e6:7.1f} us/layer, "
                  f"KV read {rate / 1e12:.2f} TB/s = {rate / copy_bw:.0%} of copy bandwidth", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", nargs="*", choices=["decode", "prefill"], default=None,
                        help="also time a grid of kernel configs (default: both kernels)")
    parser.add_argument("--overlap", action="store_true", help="only the two-stream overlap test")
    parser.add_argument("--prefill", action="store_true", help="only the prefill tiles on the engine's shapes")
    parser.add_argument("--sustained", type=int, nargs="*", default=None, metavar="ROWS",
                        help="only 8B decode layers held at the power limit, at these batch sizes (default 1024)")
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", "fp8"], default=None,
                        help="only decode attention reading a cache of each dtype (auto: bf16), at the 8B shape "
                             "unless --heads")
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 256], help="with --kv-cache-dtype: batch sizes")
    parser.add_argument("--layers", type=int, default=8, help="with --kv-cache-dtype: layer views timed per graph")
    parser.add_argument("--fp8-tiles", nargs="*", default=[], metavar="BLOCK_N,WARPS,STAGES[,MAXNREG][,halves]",
                        help="with --kv-cache-dtype: also time the FP8 cache with these decode tiles")
    parser.add_argument("--context", type=int, nargs=2, default=[100, 1048], metavar=("MIN", "MAX"),
                        help="with --kv-cache-dtype: each row's context, uniform in [MIN, MAX] tokens")
    parser.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("HEADS", "KV_HEADS"),
                        help="with --kv-cache-dtype: query and kv heads (default Qwen3-8B's; Qwen3-1.7B: 16 8)")
    parser.add_argument("--splits", type=int, nargs="*", default=[], metavar="N",
                        help="with --kv-cache-dtype: also time each dtype at these split counts (not the plan's; "
                             "the plan's shortest slice: one tile, 256 tokens for the one-warp FP8 tile)")
    parser.add_argument("--min-split-tokens", type=int, nargs="*", default=[], metavar="TOKENS",
                        help="with --splits: also each split count with no slice shorter than these (a short row "
                             "then takes fewer slices; 1: slices of one tile)")
    args = parser.parse_args()
    if args.kv_cache_dtype is not None:
        torch.manual_seed(0)
        copy_bw = copy_bandwidth()
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
        return bench_kv_cache_dtypes(args.kv_cache_dtype, args.rows, args.layers, copy_bw, args.fp8_tiles,
                                     tuple(args.context), tuple(args.heads), args.splits, args.min_split_tokens)
    if args.sustained is not None:
        torch.manual_seed(0)
        for batch in args.sustained or [1024]:  # a full 8B batch at its first decode step; smaller ones later on
            sustained_decode(batch, mean_ctx=574 if batch >= 1024 else 800)
        return
    if args.prefill:
        torch.manual_seed(0)
        return sweep_engine_prefill_shapes()
    if args.overlap:
        torch.manual_seed(0)
        for batch in (144, 288, 512):
            bench_overlap(batch)
        return
    sweep = set(args.sweep or ["decode", "prefill"]) if args.sweep is not None else set()
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  ({sm_count(torch.device('cuda'))} SMs)  "
          f"torch {torch.__version__}  triton {triton.__version__}")
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)", flush=True)
    read_bw, read_cfg = read_bandwidth()
    print(f"read only (streaming sum over 4 GiB of bf16, best of 9 kernels): {read_bw / 1e9:.0f} GB/s ({read_cfg})",
          flush=True)

    for name in SHAPES:
        bench_decode(name, 256, 1024, 256, copy_bw, sweep="decode" in sweep)
    # the engine's block size and bench.py's typical decode batch
    bench_decode("Qwen3-0.6B", 128, 1024, 64, copy_bw, sweep="decode" in sweep)
    # how the kernel's share of the read bandwidth follows the batch (bench.py's decode batch falls from 256 to 1),
    # and with ragged contexts as in a run
    for batch in (32, 64, 192):
        bench_decode("Qwen3-0.6B", batch, 1024, 64, copy_bw)
    bench_decode("Qwen3-0.6B", 128, 1024, 64, copy_bw, ragged=True)
    # splits where they matter: small batches under the engine's graphs, whose tables are max_model_len wide
    # (bench.py and bench_swap.py: 4,096; a model's default: 40,960 for Qwen3), e.g. bench_swap's rtx4070 (~33 rows)
    for batch in (1, 8, 16, 32, 48, 64):
        for table_ctx in (4096, 40960):
            bench_wide_tables(batch, table_ctx, copy_bw)
    for name in SHAPES:  # other regimes: small batch / long context (split-K), block_size 16
        bench_decode(name, 8, 8192, 256, copy_bw, other_splits=(4, 16, 32, 64))
        bench_decode(name, 256, 1024, 16, copy_bw)
    copy_bw2 = copy_bandwidth()
    print(f"device-to-device copy (again): {copy_bw2 / 1e9:.0f} GB/s", flush=True)

    for name in SHAPES:
        bench_prefill(name, [(0, 4096)] * 4, sweep="prefill" in sweep)
        bench_prefill(name, [(0, 16384)])
        bench_prefill(name, [(3000, 1000)] * 4 + [(1000, 1)] * 64)  # chunked prefill + decodes
    bench_prefill("Qwen3-0.6B", bench_py_prefill_step(), block_size=64, sweep="prefill" in sweep)


def bench_py_prefill_step(num_tokens: int = 16384) -> list[tuple[int, int]]:
    """bench.py's first step: whole prompts of U[100, 1024] tokens up to the token budget (the last one cut)."""
    rng, step = random.Random(0), []
    while sum(n for _, n in step) < num_tokens:
        step.append((0, min(rng.randint(100, 1024), num_tokens - sum(n for _, n in step))))
    return step


def sweep_engine_prefill_shapes():
    """--prefill: the tile grid on the prefill shapes the engine runs (block size 64)."""
    for name, seqs in (("Qwen3-8B", bench_py_prefill_step()), ("Qwen3-0.6B", bench_py_prefill_step()),
                       ("Qwen3-8B", [(0, 560)] * 29), ("Qwen3-8B", [(2000, 1000)] * 8)):
        bench_prefill(name, seqs, block_size=64, sweep=True)


if __name__ == "__main__":
    main()
