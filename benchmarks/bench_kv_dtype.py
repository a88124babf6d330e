"""Decode attention reading a bf16 cache against an FP8 cache (values + per-token scales), at the 8B shape.

    python benchmarks/bench_kv_dtype.py [--rows 1024] [--layers 8]

Times `paged_decode_attention` over `--layers` layer views of one block-major cache (so each layer's K/V is a
strided view, as in the engine) with CUDA events, and reports the KV bytes read per second against the device's
copy bandwidth (bytes read + written by a large copy), counting FP8 values and their scales.
"""
import argparse
import random

import torch

from nanovllm.kernels.triton_attention import KernelConfig, paged_decode_attention
from nanovllm.layers.kv_layout import KVLayout, hadamard


def copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return 2 * num_bytes / best


def run(kv_cache_dtype: str, rows: int, layers: int, lens: list[int], block_size: int = 64, kv_heads: int = 8,
        heads: int = 32, head_dim: int = 128, config: KernelConfig | None = None):
    layout = KVLayout(layers, block_size, kv_heads, head_dim, torch.bfloat16, kv_cache_dtype)
    widths = [-(-n // block_size) for n in lens]
    num_blocks = sum(widths) + 1
    kv = layout.allocate(num_blocks, torch.device("cuda"))
    if layout.is_fp8:  # realistic bytes: quantized random K/V through the store path
        from nanovllm.layers.kv_layout import quantize_fp8
        for layer in range(layers):
            views = layout.layer_views(kv, layer)
            for part in ("k", "v"):
                values, scales = quantize_fp8(torch.randn(num_blocks, block_size, kv_heads, head_dim, device="cuda"),
                                              layout.dtype)
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
    q = torch.randn(rows, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    order = torch.argsort(seq_lens, descending=True).to(torch.int32)
    views = [layout.layer_views(kv, i) for i in range(layers)]

    def step():
        for v in views:
            paged_decode_attention(q, v.k, v.v, seq_lens, tables, head_dim ** -0.5, out=out, row_order=order,
                                   k_scale=v.k_scale, v_scale=v.v_scale, config=config)
    for _ in range(3):
        step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    seconds = sorted(times)[len(times) // 2]
    bytes_per_token_head = head_dim * 2 if not layout.is_fp8 else head_dim + 2
    kv_bytes = sum(lens) * kv_heads * 2 * bytes_per_token_head * layers
    return seconds / layers, kv_bytes / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1024, 256])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--fp8-tiles", nargs="*", default=[], metavar="BLOCK_N,WARPS,STAGES",
                        help="also time the FP8 cache with these decode tiles")
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth (read + write): {bandwidth / 1e12:.2f} TB/s")
    for rows in args.rows:
        rng = random.Random(0)
        lens = [rng.randint(100, 1048) for _ in range(rows)]  # the 8B bench run's first decode step
        for kv_dtype in ("auto", "fp8"):
            per_layer, rate = run(kv_dtype, rows, args.layers, lens)
            print(f"rows {rows} kv {kv_dtype:5s}: {per_layer * 1e6:7.1f} us/layer, KV read {rate / 1e12:.2f} TB/s "
                  f"= {rate / bandwidth:.0%} of copy bandwidth")
        for tile in args.fp8_tiles:
            block_n, warps, stages = (int(x) for x in tile.split(","))
            config = KernelConfig(16, block_n, warps, stages, heads_fastest=True)
            per_layer, rate = run("fp8", rows, args.layers, lens, config=config)
            print(f"rows {rows} kv fp8 tile {tile}: {per_layer * 1e6:7.1f} us/layer, KV read {rate / 1e12:.2f} TB/s "
                  f"= {rate / bandwidth:.0%} of copy bandwidth")


if __name__ == "__main__":
    main()
