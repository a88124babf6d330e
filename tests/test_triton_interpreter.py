"""Small Triton kernels run by Triton's interpreter on CPU tensors, so they are checked without a GPU: the sampler
(nanovllm/kernels/sampling.py), SiLU-and-mul (nanovllm/kernels/activation.py), the decode attention kernel's
grid orders and split plans, and the prefill kernel with its default and old tiles. The interpreter needs
TRITON_INTERPRET=1 before triton is imported: each check runs in a subprocess."""

import pytest
from interpreter_support import interpret

pytest.importorskip("triton", reason="needs triton (the test-triton extra)")

SAMPLER = """
import json
import torch
from nanovllm.kernels.sampling import sample_tempered
res = {}
n = 400  # one interpreted program per draw
logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
for temperature in (0.6, 2.0):
    ids = sample_tempered(logits.expand(n, -1).contiguous(), torch.full((n,), temperature), seed=1)
    freq = torch.bincount(ids, minlength=5).float() / n
    res[str(temperature)] = (freq - (logits / temperature).softmax(-1)).abs().max().item()
torch.manual_seed(0)
big = torch.randn(4, 2500).to(torch.bfloat16)  # three chunks of 1,024 entries
big[0, 2100] = 50.0
big[2, 5] = 50.0
ids = sample_tempered(big, torch.tensor([0.0, 1.0, 0.0, 1.0]), seed=7)
res["greedy"] = [ids[0].item(), ids[2].item()]
flat = torch.zeros(64, 3000)
a, b, c = (sample_tempered(flat, torch.ones(64), seed=s) for s in (3, 3, 4))
res["same_seed_same_ids"] = torch.equal(a, b)
res["other_seed_changed"] = int((a != c).sum())
res["distinct_ids"] = len(set(a.tolist()))
overflow = torch.randn(4, 3000)  # an overflowed logit (an fp16 LM head past 65,504) must win, not give NaN
overflow[:2, 2345] = float("inf")
overflow[2:, 2345] = 4e33  # finite, but x * log2(e) / T overflows float32 at T = 1e-5
res["overflow"] = sample_tempered(overflow, torch.tensor([1.0, 0.7, 1e-5, 1e-5]), seed=5).tolist()
print(json.dumps(res))
"""


@pytest.mark.subprocess
def test_triton_sampler_draws_follow_the_tempered_softmax():
    res = interpret(SAMPLER)
    # 400 draws per temperature: a frequency's standard deviation is at most 0.025, and the noise is seeded, so the
    # result is the same on every run; a temperature ignored or misapplied moves a frequency by 0.19 or more
    assert res["0.6"] < 0.06 and res["2.0"] < 0.06, res
    assert res["greedy"] == [2100, 5]  # greedy rows take the argmax, here in the third and the first chunk
    assert res["same_seed_same_ids"] and res["other_seed_changed"] > 50 and res["distinct_ids"] > 50, res
    assert res["overflow"] == [2345] * 4, res  # was token 0: inf - inf made every chunk's mass NaN


SILU = """
import json
import torch
import torch.nn.functional as F
from nanovllm.kernels.activation import silu_and_mul
torch.manual_seed(0)
res = {}
for dtype in (torch.float32, torch.bfloat16):
    x = (3 * torch.randn(5, 2 * 1500)).to(dtype)  # 1,500 columns: one full block of 1,024 and a partial one
    gate, up = x.float().chunk(2, -1)
    ref = (F.silu(gate) * up).to(dtype)
    got = silu_and_mul(x)
    res[str(dtype)] = [list(got.shape), got.dtype == dtype, (got.float() - ref.float()).abs().max().item(),
                       ref.float().abs().max().item()]
res["empty"] = list(silu_and_mul(torch.zeros(0, 8)).shape)
print(json.dumps(res))
"""


@pytest.mark.subprocess
def test_triton_silu_and_mul_matches_torch():
    res = interpret(SILU)
    shape, same_dtype, err, scale = res["torch.float32"]
    assert shape == [5, 1500] and same_dtype and err < 1e-5 * scale
    shape, same_dtype, err, scale = res["torch.bfloat16"]
    assert shape == [5, 1500] and same_dtype and err <= 2 ** -7 * scale  # within one bf16 rounding
    assert res["empty"] == [0, 4]


HOST_EMBEDDING = """
import json
import torch
import torch.nn.functional as F
from nanovllm.kernels.host_embedding import gather_rows
from nanovllm.layers.embed_head import quantize_rows_int8
torch.manual_seed(0)
res = {}
table = torch.randn(50, 1500).to(torch.bfloat16)  # 1,500 columns: one full block of 1,024 and a partial one
ids = torch.tensor([3, 0, 49, 3, 17])
for id_dtype in (torch.int64, torch.int32):
    res[str(id_dtype)] = torch.equal(gather_rows(ids.to(id_dtype), table, None, 0, torch.bfloat16),
                                     F.embedding(ids, table))
q, scales = quantize_rows_int8(table)  # what the layer does: q * scale in float32, then the model's dtype
want = F.embedding(ids, q).float() * F.embedding(ids, scales)
# in float32: the interpreter's float32 -> bfloat16 truncates where CUDA rounds (tests/test_quant_gpu.py runs that)
res["int8"] = torch.equal(gather_rows(ids, q, scales, 0, torch.float32), want)
shard = table[20:40].contiguous()  # a tensor-parallel rank's rows 20..39: other ranks' ids read zeros
got = gather_rows(torch.tensor([19, 20, 39, 40, 25]), shard, None, 20, torch.bfloat16)
res["shard"] = torch.equal(got[[1, 2, 4]], table[[20, 39, 25]]) and not got[[0, 3]].any().item()
res["empty"] = list(gather_rows(torch.zeros(0, dtype=torch.int64), table, None, 0, torch.bfloat16).shape)
print(json.dumps(res))
"""


@pytest.mark.subprocess
def test_host_embedding_gather_is_the_embedding_lookup():
    """nanovllm/kernels/host_embedding.py (offload_embedding): the same rows, exactly, as F.embedding."""
    assert interpret(HOST_EMBEDDING) == {"torch.int64": True, "torch.int32": True, "int8": True, "shard": True,
                                         "empty": [0, 1500]}


DECODE_HELPERS = """
def reference(q, k_cache, v_cache, lens, tables):  # decode attention in float32 torch, [B, H, D]; empty row: zeros
    B, H, D = q.shape
    BS, KVH = k_cache.shape[1], k_cache.shape[2]
    ref = []
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            ref.append(torch.zeros(H, D))
            continue
        blocks = tables[b, :(n + BS - 1) // BS].long()
        k = k_cache[blocks].reshape(-1, KVH, D)[:n].float().repeat_interleave(H // KVH, 1)  # [n, H, D]
        v = v_cache[blocks].reshape(-1, KVH, D)[:n].float().repeat_interleave(H // KVH, 1)
        p = torch.einsum("hd,nhd->hn", q[b].float(), k).mul(D ** -0.5).softmax(-1)
        ref.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(ref)


def decode_inputs(B, NB, H=4, KVH=2, D=64, BS=16):  # seeded fp16 k_cache, v_cache [NB, BS, KVH, D] and q [B, H, D]
    torch.manual_seed(0)
    kv = torch.randn(NB, 2, BS, KVH, D, dtype=torch.float16)
    return kv[:, 0], kv[:, 1], torch.randn(B, H, D, dtype=torch.float16)
"""

DECODE_ROW_ORDER = """
import json
import torch
from nanovllm.kernels.paged_common import KernelConfig
from nanovllm.kernels.decode_attention import paged_decode_attention
""" + DECODE_HELPERS + """
B, D = 3, 64
k_cache, v_cache, q = decode_inputs(B, NB=12)
lens = torch.tensor([5, 40, 17], dtype=torch.int32)
tables = torch.tensor([[3, -1, -1], [7, 0, 9], [11, 2, -1]], dtype=torch.int32)
res = {}
ref = reference(q, k_cache, v_cache, lens, tables)
cfg = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
orders = {"batch": torch.arange(B, dtype=torch.int32), "longest_first": None, "shuffled": torch.tensor([2, 0, 1])}
outs = {}
for name, order in orders.items():
    for splits in (1, 2):
        out = paged_decode_attention(q, k_cache, v_cache, lens, tables, D ** -0.5, num_splits=splits, config=cfg,
                                     row_order=None if order is None else order.to(torch.int32))
        res[f"{name}/{splits}"] = ((out.float() - ref).norm() / ref.norm()).item()
        outs.setdefault(splits, []).append(out.float().tolist())
res["same_outputs"] = all(o == outs[s][0] for s in outs for o in outs[s])
print(json.dumps(res))
"""


@pytest.mark.subprocess
def test_decode_row_order_changes_nothing_but_the_launch():
    """The decode kernel reads row row_order[i] in the grid's row i (the engine passes the rows longest context
    first; None sorts them in the wrapper): any permutation gives exactly the same outputs, with and without
    splits, and they match a torch reference."""
    res = interpret(DECODE_ROW_ORDER)
    assert res.pop("same_outputs"), res
    assert len(res) == 6 and all(err < 1e-2 for err in res.values()), res


DECODE_ROW_SPLITS = """
import json
import torch
from nanovllm.kernels.paged_common import KernelConfig
from nanovllm.kernels.decode_attention import paged_decode_attention
""" + DECODE_HELPERS + """
B, D = 4, 64
k_cache, v_cache, q = decode_inputs(B, NB=40)
lens = torch.tensor([5, 40, 17, 0], dtype=torch.int32)  # a table 8 blocks (128 tokens) wide, as under a graph
tables = torch.full((B, 8), -1, dtype=torch.int32)
tables[0, :1], tables[1, :3], tables[2, :2] = torch.tensor([3]), torch.tensor([7, 0, 9]), torch.tensor([11, 2])
ref = reference(q, k_cache, v_cache, lens, tables)
res = {}
cfg = KernelConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
for splits in (1, 2, 3, 8):
    out = paged_decode_attention(q, k_cache, v_cache, lens, tables, D ** -0.5, num_splits=splits, config=cfg)
    res[f"{splits}"] = ((out.float() - ref).norm() / ref.norm()).item()
    res[f"{splits}/empty_row"] = out[3].abs().max().item()
# slices of at least 20 tokens, rounded up to two tiles: the 40-token row in 2 slices of 8 asked, the 17-token one in 1
out = paged_decode_attention(q, k_cache, v_cache, lens, tables, D ** -0.5, num_splits=8, config=cfg,
                             min_split_tokens=20)
res["8/min20"] = ((out.float() - ref).norm() / ref.norm()).item()
res["8/min20/empty_row"] = out[3].abs().max().item()
print(json.dumps(res))
"""


@pytest.mark.subprocess
def test_decode_row_splits_match_a_reference():
    """Each row cuts its own context into the splits, in a table wider than any row (as under a CUDA graph,
    max_model_len wide): the 40-token row in 2, 3 and 8 slices of >= 16 tokens, the 5-token row in one, and an
    empty row gives zeros. With one split (a full GPU) the kernel reads the row's whole context: a plan that gave
    it no tokens to read made the outputs zeros (bench.py "2x faster"). A minimum slice length leaves long rows
    fewer, longer slices, which the reduce must count as the kernel cut them."""
    res = interpret(DECODE_ROW_SPLITS)
    assert len(res) == 10 and all(err == 0.0 for key, err in res.items() if key.endswith("empty_row")), res
    assert all(err < 1e-2 for key, err in res.items() if not key.endswith("empty_row")), res


def test_split_plan_follows_the_batch_not_the_table_width():
    from nanovllm.kernels.decode_attention import decode_split_plan
    # 32 rows x 8 kv heads on 132 SMs: 3 splits reach 4 programs per SM (the kernel cuts each row itself)
    assert decode_split_plan(32, 8, 64, 64, 64, 132) == 3
    # no more slices than slice_tokens-long pieces of the table; a full GPU takes no split
    assert decode_split_plan(1, 8, 2, 64, 64, 132) == 2
    assert decode_split_plan(1, 8, 2, 64, 256, 132) == 1
    assert decode_split_plan(256, 8, 64, 64, 64, 132) == 1
    # a target of 16 programs per SM where the batch leaves an SM under 4: 20 rows take 14 slices; 66 rows reach 4
    assert decode_split_plan(20, 8, 128, 64, 64, 132, programs_per_sm=16) == 14
    assert decode_split_plan(64, 8, 128, 64, 64, 132, programs_per_sm=16) == 5
    assert decode_split_plan(66, 8, 128, 64, 64, 132, programs_per_sm=16) == 1
    # a given count is only clamped to [1, 64]
    assert decode_split_plan(4, 8, 64, 64, 64, 132, num_splits=5) == 5
    assert decode_split_plan(4, 8, 64, 64, 64, 132, num_splits=500) == 64


def test_decode_launch_plan_by_cache_dtype_and_batch():
    """(splits, tile, shortest slice) for 8 kv heads on 132 SMs, block 64, a table 8,192 tokens wide."""
    import torch
    from nanovllm.kernels.decode_attention import (_FP8_DECODE_TILE, _FP8_FULL_GRID_TILE, KernelConfig,
                                                   decode_config, plan_decode_launch)

    def plan(batch, fp8=True, dtype=torch.bfloat16, width_blocks=128, **kw):
        launch = plan_decode_launch(dtype, 128, batch, 8, width_blocks, 64, 132, fp8, **kw)
        return launch.splits, launch.config, launch.min_slice_tokens

    # FP8, few rows: the one-warp tile's 16 slots per SM filled, slices of at least 256 tokens
    assert plan(20) == (14, _FP8_DECODE_TILE, 256)
    assert plan(20, min_split_tokens=1) == (14, _FP8_DECODE_TILE, 32)  # one tile
    assert plan(20, width_blocks=6) == (2, _FP8_DECODE_TILE, 256)  # a 384-token table: two 256-token pieces
    assert plan(64) == (5, _FP8_DECODE_TILE, 256)
    # FP8, unsplit: 16 keys a step from 24 programs per SM waiting (396 rows x 8 heads = 3,168 = 24 x 132)
    assert plan(66) == (1, _FP8_DECODE_TILE, 256)
    assert plan(395) == (1, _FP8_DECODE_TILE, 256)
    assert plan(396) == (1, _FP8_FULL_GRID_TILE, 256)
    assert plan(1024) == (1, _FP8_FULL_GRID_TILE, 256)
    # the FP8 cache read by a 4-warp tile (fp32 queries; or a caller's tile) plans as bf16 does: 4 per SM
    fp32_tile = decode_config(torch.float32, 128, 64, True, fp8=True)
    assert plan(20, dtype=torch.float32) == (4, fp32_tile, 32)
    assert plan(20, config=KernelConfig(16, 32, 4, 3)) == (4, KernelConfig(16, 32, 4, 3), 32)
    # bf16: 4 programs per SM in one-tile slices; never the FP8 tiles
    bf16_split = decode_config(torch.bfloat16, 128, 64, True)
    assert plan(20, fp8=False) == (4, bf16_split, bf16_split.block_n)
    assert plan(1024, fp8=False)[:2] == (1, decode_config(torch.bfloat16, 128, 64, False))
    # forced counts are kept; the shortest slice is still the plan's
    assert plan(1024, num_splits=3) == (3, _FP8_DECODE_TILE, 256)


PREFILL = """
import json, os
import torch
from nanovllm.kernels.prefill_attention import paged_prefill_attention
torch.manual_seed(0)
block_size, num_heads, num_kv_heads, head_dim = int(os.environ["BLOCK_SIZE"]), 4, 2, 64
batch = [(0, 70), (37, 29), (130, 1)]  # (cached prefix, new tokens): a whole prompt, a chunk after a prefix, a decode
seq_lens = [p + n for p, n in batch]
widths = [-(-s // block_size) for s in seq_lens]
num_blocks = sum(widths) + 3
perm = torch.randperm(num_blocks).tolist()  # scattered blocks, -1 past each row's end
tables = torch.full((len(batch), max(widths)), -1, dtype=torch.int32)
start = 0
for i, w in enumerate(widths):
    tables[i, :w] = torch.tensor(perm[start:start + w])
    start += w
k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).half()  # the interpreter has no bf16
v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).half()
qlens = [n for _, n in batch]
q = torch.randn(sum(qlens), num_heads, head_dim).half()
cu = torch.tensor([0] + qlens, dtype=torch.int32).cumsum(0).to(torch.int32)  # query offsets
scale = head_dim ** -0.5
out = paged_prefill_attention(q, k_cache, v_cache, cu, torch.tensor(seq_lens, dtype=torch.int32), tables, max(qlens),
                              scale)
errs = []
for i, ((prefix, n), s) in enumerate(zip(batch, seq_lens)):
    ids = tables[i, :widths[i]].long()
    k = k_cache[ids].flatten(0, 1)[:s].float().repeat_interleave(2, 1)  # [s, H, D]
    v = v_cache[ids].flatten(0, 1)[:s].float().repeat_interleave(2, 1)
    qi = q[cu[i]:cu[i + 1]].float()
    scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
    visible = torch.arange(s)[None, :] <= torch.arange(prefix, s)[:, None]  # causal over prefix + new tokens
    ref = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    errs.append(((out[cu[i]:cu[i + 1]].float() - ref).abs().max() / ref.abs().max()).item())
print(json.dumps({"errs": errs}))
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("tile", ["", "128,64,4,3"])  # the default (64, 64, 4, 3), and the old tile
@pytest.mark.parametrize("block_size", [16, 64])  # cache blocks smaller than, and as large as, the 64-key tile
def test_prefill_kernel_matches_a_reference(block_size, tile, monkeypatch):
    monkeypatch.setenv("BLOCK_SIZE", str(block_size))  # read by the subprocess, with the tile
    monkeypatch.setenv("NANOVLLM_PREFILL_TILE", tile)
    errs = interpret(PREFILL)["errs"]
    assert max(errs) < 5e-3, errs  # fp16 inputs, fp32 accumulation


def test_prefill_tile_switch_rejects_a_malformed_value(switches):
    import torch
    from nanovllm.kernels.paged_common import tile_from_env
    from nanovllm.kernels.prefill_attention import prefill_config
    switches(prefill_tile="64,64,4")
    with pytest.raises(ValueError, match="NANOVLLM_PREFILL_TILE='64,64,4'"):
        tile_from_env("NANOVLLM_PREFILL_TILE")
    switches(prefill_tile="128,32,8,2")
    tile = tile_from_env("NANOVLLM_PREFILL_TILE")
    assert (tile.block_m, tile.block_n) == (128, 32)
    switches(prefill_tile="")
    assert tile_from_env("NANOVLLM_PREFILL_TILE") is None
    assert prefill_config(torch.bfloat16, 128).block_m == 64  # this process imported the module without the switch


def test_decode_tile_switch_sets_only_unsplit_half_precision_launches(monkeypatch):
    import torch
    from nanovllm.kernels import decode_attention
    from nanovllm.kernels.decode_attention import decode_config
    from nanovllm.kernels.paged_common import KernelConfig
    default = decode_config(torch.bfloat16, 128, 64, split=False)
    assert (default.block_n, default.num_warps, default.num_stages) == (64, 4, 3)
    monkeypatch.setattr(decode_attention, "_DECODE_TILE", KernelConfig(64, 32, 2, 4))  # as NANOVLLM_DECODE_TILE sets it
    tile = decode_config(torch.bfloat16, 128, 64, split=False)
    assert (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages) == (16, 32, 2, 4)  # block_m stays 16
    assert decode_config(torch.bfloat16, 128, 64, split=True) == default  # split launches keep the default
    assert decode_config(torch.float32, 128, 64, split=False).block_n == 32  # fp32 keeps its own tile
    assert decode_config(torch.bfloat16, 128, 256, split=False).block_n == 128  # large blocks keep theirs
