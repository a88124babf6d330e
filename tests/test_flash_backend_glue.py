"""FlashBackend's glue (cu_seqlens, block tables, the mixed batch, CUDA-graph padding) on the CPU, through a
stand-in flash_attn module with flash-attn's signatures and semantics (tests/flash_attn_standin.py), against the
torch reference backend; and "auto" never picks flash-attn, even when it is importable."""
import pytest
import torch
import torch.nn.functional as F

# the flash backend keeps Triton's decode kernel
pytest.importorskip("triton", reason="needs triton (the test-triton extra)")

import flash_attn_standin  # noqa: E402
from nanovllm.config import Config
from nanovllm.layers.attention import FlashBackend, TorchBackend, TritonBackend, select_backend
from nanovllm.layers.kv_layout import LayerKV
from nanovllm.utils.context import AttentionMetadata

BS = 256  # flash-attn's paged KV needs a multiple of 256
H, KVH, D = 4, 2, 64
SCALE = D ** -0.5
DTYPE = torch.bfloat16


@pytest.fixture()
def flash(monkeypatch):
    flash_attn_standin.install(monkeypatch)
    return FlashBackend()


def make_cache(num_blocks: int, seed: int = 0):
    """Views of a block-major cache like the runner's: kv[num_blocks, layers, K/V, BS, KVH, D], dim 0 strided."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, 2, 2, BS, KVH, D, generator=g).to(DTYPE)
    return kv[:, 1, 0], kv[:, 1, 1]


def make_metadata(rows, num_blocks: int, seed: int = 0, table_width: int | None = None) -> AttentionMetadata:
    """rows: (seq_len, query_len) per sequence, its context after this step and how many of its last tokens are
    queries. Each sequence gets distinct shuffled block ids; tables are padded with -1 (the runner's padding)."""
    g = torch.Generator().manual_seed(seed)
    block_ids = torch.randperm(num_blocks, generator=g).tolist()
    width = table_width or max(-(-seq_len // BS) for seq_len, _ in rows)
    tables = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, (seq_len, _) in enumerate(rows):
        n = -(-seq_len // BS)
        tables[i, :n] = torch.tensor([block_ids.pop() for _ in range(n)], dtype=torch.int32)
    query_lens = [q for _, q in rows]
    seq_lens = [s for s, _ in rows]
    return AttentionMetadata(
        is_decode_only=all(q == 1 for q in query_lens), slot_mapping=torch.empty(0, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        cu_seqlens_q=F.pad(torch.tensor(query_lens).cumsum(0), (1, 0)).to(torch.int32),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


def queries(num_tokens: int, seed: int = 1):
    return torch.randn(num_tokens, H, D, generator=torch.Generator().manual_seed(seed)).to(DTYPE)


def assert_close(got, want):
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [
    [(300, 300)],  # a whole prompt over two blocks
    [(700, 45), (256, 256), (19, 19)],  # a chunk after a cached prefix, a prompt of exactly one block, a short one
])
def test_prefill_matches_the_torch_reference(flash, rows):
    k_cache, v_cache = make_cache(8)
    md = make_metadata(rows, 8)
    q = queries(sum(ql for _, ql in rows))
    want = TorchBackend().prefill(q, LayerKV(k_cache, v_cache), md, SCALE)
    out = torch.empty_like(q)
    assert flash.prefill(q, LayerKV(k_cache, v_cache), md, SCALE, out=out) is out
    assert_close(out, want)
    assert flash_attn_standin.CALLS == ["varlen"]


def test_the_mixed_batch_goes_through_varlen_whole(flash):
    """Decode rows (one query) and prompt chunks in one varlen call: causal alignment to the bottom-right makes
    a one-query row see its whole context. The torch reference splits the batch as the runner does for it."""
    rows = [(37, 1), (513, 1), (600, 45), (20, 20)]
    k_cache, v_cache = make_cache(8)
    md = make_metadata(rows, 8)
    assert not flash.splits_mixed_steps and not md.is_decode_only
    q = queries(1 + 1 + 45 + 20)
    torch_backend = TorchBackend()
    want = torch.cat([torch_backend.decode(q[:2], LayerKV(k_cache, v_cache), make_metadata(rows[:2], 8), SCALE),
                      torch_backend.prefill(q[2:], LayerKV(k_cache, v_cache), _tail(md, 2), SCALE)])
    assert_close(flash.prefill(q, LayerKV(k_cache, v_cache), md, SCALE), want)


def _tail(md: AttentionMetadata, d: int) -> AttentionMetadata:
    """The rows from d on, as the runner's prefill_part (cu_seqlens_q from 0)."""
    query_lens, seq_lens = md.query_lens_cpu[d:], md.seq_lens_cpu[d:]
    return AttentionMetadata(False, md.slot_mapping, md.seq_lens[d:], md.block_tables[d:],
                             F.pad(torch.tensor(query_lens).cumsum(0), (1, 0)).to(torch.int32), max(query_lens),
                             max(seq_lens), query_lens, seq_lens)


def test_decode_matches_the_torch_reference_with_graph_padding(flash):
    """A CUDA graph's buffers: rows past the batch have seq_len 1 and block 0, tables are wider and clamped."""
    rows = [(1, 1), (255, 1), (256, 1), (257, 1), (900, 1)]
    k_cache, v_cache = make_cache(12)
    md = make_metadata(rows, 12)
    q = queries(len(rows))
    want = TorchBackend().decode(q, LayerKV(k_cache, v_cache), md, SCALE)
    assert_close(flash.decode(q, LayerKV(k_cache, v_cache), md, SCALE), want)
    n, padded = len(rows), 8
    graph_md = AttentionMetadata(True, md.slot_mapping, torch.ones(padded, dtype=torch.int32),
                                 torch.zeros(padded, 6, dtype=torch.int32), max_seq_len=1)
    graph_md.seq_lens[:n] = md.seq_lens
    graph_md.block_tables[:n, :md.block_tables.size(1)] = md.block_tables.clamp(min=0)
    out = torch.zeros(padded, H, D, dtype=DTYPE)
    flash.decode(torch.cat([q, queries(padded - n, seed=2)]), LayerKV(k_cache, v_cache), graph_md, SCALE, out=out)
    assert_close(out[:n], want)
    assert flash_attn_standin.CALLS == ["with_kvcache", "with_kvcache"]


def test_auto_never_picks_flash_attn(monkeypatch):
    flash_attn_standin.install(monkeypatch)  # importable, as it is for many users of this field
    assert type(select_backend("auto", torch.device("cuda"), 256)) is TritonBackend
    assert type(select_backend("auto", torch.device("cpu"), 256)) is TorchBackend
    assert type(select_backend("flash", torch.device("cuda"), 256)) is FlashBackend  # when asked for
    with pytest.raises(ValueError, match="attention_backend='flash' needs kvcache_block_size a multiple of 256"):
        select_backend("flash", torch.device("cuda"), 64)


def test_the_block_size_default_does_not_follow_flash_attn(monkeypatch, qwen3_dir):
    flash_attn_standin.install(monkeypatch)
    assert Config(qwen3_dir, device="cuda").kvcache_block_size == 64
    assert Config(qwen3_dir, device="auto").kvcache_block_size == 64
    assert Config(qwen3_dir, device="cuda", attention_backend="flash").kvcache_block_size == 256
