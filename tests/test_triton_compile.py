"""Every Triton kernel of the project compiles for an H100/H200 (sm_90) and for an RTX 40-series GPU (sm_89) on a
machine without a GPU, within the shared memory a block may use there.

Triton's interpreter, which the CPU tests run the kernels in, does not type-check: a kernel it runs correctly can
still fail to compile (an early fused rope kernel did, for a value that changed shape across an `if`). Here the
kernels' own Python wrappers are called on CPU tensors under a stand-in CUDA driver that names sm_90 as the
target, and each launch is turned into a compile without a launch. Runs in a subprocess: the stand-in driver is
process-wide. Triton checks a kernel's shared memory against the device only when it loads the kernel, so a tile
tuned on an H200 (227 KB a block) that needs more than an RTX 4070 has (99 KB) would fail only on the user's GPU:
each compile's shared memory is checked here against the target's limit."""
import pytest
import torch
from triton_standin import run_compile_script

pytest.importorskip("triton", reason="needs triton (the test-triton extra)")
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels"),
              pytest.mark.subprocess, pytest.mark.slow]  # each kernel compiled for two GPUs, in a process

COMPILE_ALL = r"""
import sys

import torch
from triton_standin import compile_instead_of_launching

TARGET_CC, SHARED_LIMIT_BYTES = int(sys.argv[1]), int(sys.argv[2])
compiled = compile_instead_of_launching(TARGET_CC, SHARED_LIMIT_BYTES)

from nanovllm.kernels import activation, rope_store, sampling
from nanovllm.kernels import decode_attention, host_embedding, prefill_attention, store_kv

T = 5
CASES = [  # dtype, head_dim, block_size, (num_heads, num_kv_heads): the engine's shapes, then the edge cases
    (torch.bfloat16, 128, 64, (16, 8)),  # Qwen3 at the default block size
    (torch.bfloat16, 128, 256, (32, 8)),
    (torch.float16, 64, 16, (8, 1)),  # small heads, multi-query
    (torch.bfloat16, 96, 64, (12, 4)),  # a head_dim that is not a power of two (padded tiles)
    (torch.float32, 64, 16, (4, 2)),  # the float32 parity tests
]
for dtype, head_dim, block_size, (num_heads, num_kv_heads) in CASES:
    kv = torch.zeros(4, 2, 2, block_size, num_kv_heads, head_dim, dtype=dtype)
    k_cache, v_cache = kv[:, 1, 0], kv[:, 1, 1]
    k, v = (torch.randn(T, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
    slots = torch.arange(T, dtype=torch.int64)
    store_kv.store_kvcache(k, v, k_cache, v_cache, slots)
    q = torch.randn(T, num_heads, head_dim, dtype=dtype)
    seq_lens, block_tables = torch.tensor([2, 3], dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    for max_query_len in (1, 3, 300):  # the tile-size classes
        prefill_attention.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 2, 5], dtype=torch.int32),
                                                  seq_lens, block_tables, max_query_len, 0.1)
    for num_splits in (1, 3):
        decode_attention.paged_decode_attention(q[:2], k_cache, v_cache, seq_lens, block_tables, 0.1,
                                                num_splits=num_splits)
    if head_dim != 96:  # the fused kernel needs head_dim / 2 a power of two (the runner checks)
        qkv = torch.randn(T, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
        cos_sin = torch.randn(64, head_dim)
        for weight in (None, torch.ones(head_dim, dtype=dtype)):
            rope_store.rope_store_kvcache(qkv, slots, cos_sin, num_heads, num_kv_heads, head_dim, k_cache, v_cache,
                                          slots, weight, weight)
from nanovllm.kernels.paged_common import KernelConfig
from nanovllm.layers.kv_layout import KVLayout
HALVES = [decode_attention._FP8_FULL_GRID_TILE, KernelConfig(16, 32, 2, 4, fp8_d_halves=True),
          KernelConfig(16, 16, 1, 4, 80, fp8_d_halves=True)]  # the full-grid tile and others bench_attention times
for kv_cache_dtype in ("fp8_e4m3", "fp8_e5m2"):  # FP8 caches: uint8 blocks viewed as FP8 values and bf16 scales
    layout = KVLayout(2, 64, 8, 128, torch.bfloat16, kv_cache_dtype)
    views = layout.layer_views(torch.zeros(4, layout.block_bytes, dtype=torch.uint8), 1)
    scales = dict(k_scale=views.k_scale, v_scale=views.v_scale)
    k, v = (torch.randn(T, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.arange(T, dtype=torch.int64)
    store_kv.store_kvcache(k, v, views.k, views.v, slots, **scales)
    q = torch.randn(T, 32, 128, dtype=torch.bfloat16)
    seq_lens, block_tables = torch.tensor([2, 3], dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int32)
    for max_query_len in (1, 3, 300):
        prefill_attention.paged_prefill_attention(q, views.k, views.v, torch.tensor([0, 2, 5], dtype=torch.int32),
                                                  seq_lens, block_tables, max_query_len, 0.1, **scales)
    for num_splits, config in [(1, None), (3, None)] + [(1, c) for c in HALVES]:
        decode_attention.paged_decode_attention(q[:2], views.k, views.v, seq_lens, block_tables, 0.1,
                                                num_splits=num_splits, config=config, **scales)
    qkv = torch.randn(T, 48 * 128, dtype=torch.bfloat16)
    rope_store.rope_store_kvcache(qkv, slots, torch.randn(64, 128), 32, 8, 128, views.k, views.v, slots,
                                  rotation=torch.eye(128), **scales)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    activation.silu_and_mul(torch.randn(T, 2 * 3072, dtype=dtype))
    sampling.sample_tempered(torch.randn(3, 151936, dtype=dtype), torch.ones(3), seed=1)
ids = torch.tensor([1, 2], dtype=torch.int64)  # the offloaded embedding, its model-dtype and int8 tables
host_embedding.gather_rows(ids, torch.zeros(8, 4096, dtype=torch.bfloat16), None, 0, torch.bfloat16)
host_embedding.gather_rows(ids, torch.zeros(8, 4096, dtype=torch.int8), torch.ones(8, 1), 0, torch.bfloat16)
print(" ".join(sorted(compiled)))
"""


# (compute capability, the most shared memory a block may use there: cudaDevAttrMaxSharedMemoryPerBlockOptin)
@pytest.mark.parametrize("cc, shared_limit_bytes", [(90, 232448), (89, 101376)], ids=["sm90-h200", "sm89-rtx4070"])
def test_every_triton_kernel_compiles_within_shared_memory(cc, shared_limit_bytes):
    proc = run_compile_script(COMPILE_ALL, [cc, shared_limit_bytes], timeout_s=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["_chunk_stats_kernel", "_decode_kernel", "_decode_reduce_kernel",
                                   "_gather_rows_kernel", "_prefill_kernel", "_rope_store_kernel", "_row_sample_kernel",
                                   "_silu_and_mul_kernel", "_store_kvcache_kernel"]
