"""GPU tests for the paged-attention kernels (nanovllm/kernels/store_kv.py, prefill_attention.py,
decode_attention.py) against a pure-torch reference.

Skipped without CUDA. The cache is always the engine's real layout
``kv[num_blocks, num_layers=3, 2, block_size, H, D]`` seen through the non-contiguous layer-1 views,
with permuted (non-sequential) block ids and garbage (-1) past each sequence's blocks.
"""

import itertools
import math

import pytest
import torch

pytestmark = pytest.mark.gpu

DEVICE = "cuda"  # the CPU interpreter (TRITON_INTERPRET=1) can be used by overriding this
NUM_LAYERS, LAYER = 3, 1
LOW = torch.bfloat16  # 16-bit dtype of the single-dtype tests (the CPU interpreter only handles fp16 dots)
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 5e-3}  # fp32 dots run in tf32


def _kernels():
    from types import SimpleNamespace

    from nanovllm.kernels.decode_attention import paged_decode_attention
    from nanovllm.kernels.prefill_attention import paged_prefill_attention
    from nanovllm.kernels.store_kv import store_kvcache

    return SimpleNamespace(store_kvcache=store_kvcache, paged_prefill_attention=paged_prefill_attention,
                           paged_decode_attention=paged_decode_attention)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    """Full cache kv[N, L, 2, bs, H, D] and the layer-1 views k_cache, v_cache [N, bs, H, D]."""
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    return kv, kv[:, LAYER, 0], kv[:, LAYER, 1]


def make_block_tables(seq_lens, block_size, extra_cols=2, extra_blocks=3):
    """Block tables [B, width] using a random permutation of block ids; unused entries are -1."""
    needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(needed) + extra_blocks
    perm = torch.randperm(num_blocks).tolist()
    width = max(needed) + extra_cols
    tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    it = iter(perm)
    for i, nb in enumerate(needed):
        for j in range(nb):
            tables[i, j] = next(it)
    return tables.to(DEVICE), num_blocks


def packed_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype):
    """q, k, v as non-contiguous views of one packed [T, (H + 2*Hkv) * D] projection output."""
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    q_sz, kv_sz = num_heads * head_dim, num_kv_heads * head_dim
    q = qkv[:, :q_sz].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_sz:q_sz + kv_sz].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_sz + kv_sz:].view(num_tokens, num_kv_heads, head_dim)
    return q, k, v


def ref_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, scale):
    """Per-sequence gather + float32 causal softmax attention. q: [T, H, D] -> [T, H, D] fp32."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    cu, lens, tables = cu_seqlens_q.tolist(), seq_lens.tolist(), block_tables.long().cpu()
    outs = []
    for i, seq_len in enumerate(lens):
        qi = q[cu[i]:cu[i + 1]].float()  # [qlen, H, D]
        qlen = qi.shape[0]
        blocks = tables[i, :math.ceil(seq_len / block_size)].to(k_cache.device)
        k = k_cache[blocks].reshape(-1, *k_cache.shape[2:])[:seq_len].float()  # [L, Hkv, D]
        v = v_cache[blocks].reshape(-1, *v_cache.shape[2:])[:seq_len].float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [H, qlen, L]
        q_pos = torch.arange(seq_len - qlen, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        s = s.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
    return torch.cat(outs)


def cu_seqlens(qlens):
    return torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32, device=DEVICE)


HEAD_CONFIGS = [(4, 4), (8, 4), (8, 2)]  # (q heads, kv heads): GQA ratios 1, 2, 4


# ---------------------------------------------------------------------------------------------
# store_kvcache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kvcache(dtype, head_dim, block_size, slot_dtype):
    torch.manual_seed(0)
    num_tokens, num_heads, num_kv_heads, num_blocks = 37, 8, 2, 5
    kv, k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    _, key, value = packed_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[::5] = -1  # padding entries are skipped
    expected = kv.clone()
    valid = slots >= 0
    blk, off = slots[valid] // block_size, slots[valid] % block_size
    expected[blk, LAYER, 0, off] = key[valid]
    expected[blk, LAYER, 1, off] = value[valid]

    _kernels().store_kvcache(key, value, k_cache, v_cache, slots.to(slot_dtype))
    assert torch.equal(kv, expected)  # also checks the other layers and K/V halves are untouched


# ---------------------------------------------------------------------------------------------
# prefill
# ---------------------------------------------------------------------------------------------

# (prefix length, query length): qlen-1 rows mixed with long rows, prefixes not block-aligned
PREFILL_BATCH = [(0, 1), (13, 37), (500, 1), (77, 300), (259, 5), (0, 130), (16, 16)]


def _run_prefill(dtype, head_dim, block_size, num_heads, num_kv_heads, batch=PREFILL_BATCH):
    torch.manual_seed(1)
    _, qlens = zip(*batch)
    seq_lens = [p + n for p, n in batch]
    tables, num_blocks = make_block_tables(seq_lens, block_size)
    _, k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q, _, _ = packed_qkv(sum(qlens), num_heads, num_kv_heads, head_dim, dtype)
    cu = cu_seqlens(qlens)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim ** -0.5
    out = _kernels().paged_prefill_attention(q, k_cache, v_cache, cu, lens, tables, max(qlens), scale)
    ref = ref_attention(q, k_cache, v_cache, cu, lens, tables, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("block_size", [16, 64, 256])  # below, equal to and above the default tile's 64 keys
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill(dtype, head_dim, block_size, heads):
    _run_prefill(dtype, head_dim, block_size, *heads)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_prefill_padded_head_dim(head_dim):
    _run_prefill(LOW, head_dim, 16, 8, 2)


def test_prefill_fp32():
    _run_prefill(torch.float32, 128, 16, 8, 4)


def test_prefill_decode_only_batch():
    """All queries of length 1 (the small-tile path)."""
    _run_prefill(LOW, 128, 256, 16, 8, batch=[(0, 1), (300, 1), (1023, 1), (5, 1)])


# ---------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------

DECODE_SEQ_LENS = [1, 17, 256, 1000, 2000, 255, 513]


def _decode_inputs(dtype, head_dim, block_size, num_heads, num_kv_heads, seq_lens, extra_cols=2):
    tables, num_blocks = make_block_tables(seq_lens, block_size, extra_cols=extra_cols)
    _, k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q = packed_qkv(len(seq_lens), num_heads, num_kv_heads, head_dim, dtype)[0]  # [B, H, D] (strided)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, lens, tables


def _decode_ref(q, k_cache, v_cache, lens, tables, scale):
    return ref_attention(q, k_cache, v_cache, cu_seqlens([1] * q.shape[0]), lens, tables, scale)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("heads", HEAD_CONFIGS)
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode(dtype, head_dim, block_size, heads, num_splits):
    torch.manual_seed(2)
    q, k_cache, v_cache, lens, tables = _decode_inputs(dtype, head_dim, block_size, *heads, DECODE_SEQ_LENS)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan")).contiguous()
    res = _kernels().paged_decode_attention(q, k_cache, v_cache, lens, tables, scale, out=out,
                                            num_splits=num_splits)
    assert res is out
    ref = _decode_ref(q, k_cache, v_cache, lens, tables, scale)
    assert torch.isfinite(out).all()
    err = rel_err(out, ref)
    assert err < TOL[dtype], err


@pytest.mark.parametrize("head_dim", [80, 96])
def test_decode_padded_head_dim(head_dim):
    torch.manual_seed(3)
    q, k_cache, v_cache, lens, tables = _decode_inputs(LOW, head_dim, 16, 8, 2, DECODE_SEQ_LENS)
    out = _kernels().paged_decode_attention(q, k_cache, v_cache, lens, tables, 0.1)
    assert rel_err(out, _decode_ref(q, k_cache, v_cache, lens, tables, 0.1)) < 1e-2


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_fp32(num_splits):
    torch.manual_seed(4)
    q, k_cache, v_cache, lens, tables = _decode_inputs(torch.float32, 128, 16, 8, 4, DECODE_SEQ_LENS)
    out = _kernels().paged_decode_attention(q, k_cache, v_cache, lens, tables, 0.088, num_splits=num_splits)
    assert rel_err(out, _decode_ref(q, k_cache, v_cache, lens, tables, 0.088)) < TOL[torch.float32]


def test_decode_zero_length_rows_are_finite():
    """CUDA-graph padding rows may carry seq_len 0: they must not produce NaN/inf."""
    torch.manual_seed(5)
    q, k_cache, v_cache, lens, tables = _decode_inputs(LOW, 128, 256, 8, 4, [300, 5])
    lens[1] = 0
    for splits in (1, 4):
        out = _kernels().paged_decode_attention(q, k_cache, v_cache, lens, tables, 0.1, num_splits=splits)
        assert torch.isfinite(out).all()
        assert out[1].abs().max().item() == 0.0
        ref = _decode_ref(q[:1], k_cache, v_cache, lens[:1], tables[:1], 0.1)
        assert rel_err(out[:1], ref) < 1e-2


def test_decode_wide_table_small_batch():
    """Few sequences, block table much wider than the contexts: many slices are empty."""
    torch.manual_seed(6)
    q, k_cache, v_cache, lens, tables = _decode_inputs(LOW, 128, 16, 16, 8, [3000, 40, 1],
                                                       extra_cols=2000)
    out = _kernels().paged_decode_attention(q, k_cache, v_cache, lens, tables, 0.1)
    assert rel_err(out, _decode_ref(q, k_cache, v_cache, lens, tables, 0.1)) < 1e-2


@pytest.mark.parametrize("batch", [4, 64])
def test_decode_cuda_graph(batch):
    """Capture with static buffers, replay with new q / cache contents / lengths / tables."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    torch.manual_seed(7)
    kern = _kernels()
    dtype, head_dim, block_size, num_heads, num_kv_heads = LOW, 128, 16, 16, 8
    max_len, width = 700, 50  # 50 blocks x 16 = 800 tokens of table width
    num_blocks = batch * width
    kv, k_cache, v_cache = make_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=DEVICE)
    lens = torch.randint(1, max_len, (batch,), dtype=torch.int32, device=DEVICE)
    tables = torch.randperm(num_blocks, device=DEVICE).view(batch, width).to(torch.int32)
    out = torch.empty_like(q)
    scale = head_dim ** -0.5

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        kern.paged_decode_attention(q, k_cache, v_cache, lens, tables, scale, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern.paged_decode_attention(q, k_cache, v_cache, lens, tables, scale, out=out)

    for _ in range(2):  # replay twice with fresh data each time
        q.copy_(torch.randn_like(q))
        kv.copy_(torch.randn_like(kv))
        lens.copy_(torch.randint(1, max_len, (batch,), dtype=torch.int32, device=DEVICE))
        lens[0] = width * block_size  # one sequence fills the whole table
        tables.copy_(torch.randperm(num_blocks, device=DEVICE).view(batch, width).to(torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = _decode_ref(q, k_cache, v_cache, lens, tables, scale)
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < 1e-2
