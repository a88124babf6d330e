"""The engine's quantized layouts (nanovllm/layers/quantization/layout.py): the nibble order, the reference
dequantization's formula (a multiply, then an add, each rounded to float32), FP8 blocks that overhang the weight,
and a layer loaded straight from layout tensors (layout_spec, for loaders that repack by themselves: GGUF)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanovllm.layers.quantization.layout import dequantize_fp8, dequantize_int, pack_int4, unpack_int4
from nanovllm.utils.quant_spec import layout_spec


def test_nibble_i_of_word_j_is_element_8j_plus_i():
    q = torch.randint(0, 16, (3, 24), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 3)
    for n in range(3):
        for k in range(24):  # the contract's own words, on the int32 read as unsigned bits
            assert (int(packed[n, k // 8]) & 0xFFFFFFFF) >> (4 * (k % 8)) & 0xF == q[n, k]
    assert torch.equal(unpack_int4(packed).long(), q)
    assert pack_int4(torch.full((1, 8), 15))[0, 0] == -1  # all bits set: the sign bit too


def test_int_dequantization_is_a_float32_multiply_then_add():
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (4, 64), generator=g)
    scales = (torch.rand(4, 2, generator=g) / 7).to(torch.float16)
    mins = -torch.rand(4, 2, generator=g) / 3  # float32
    got = dequantize_int(pack_int4(q), scales, mins, 4, 32)
    s32, m32 = scales.float().numpy(), mins.numpy()
    expected = np.empty((4, 64), np.float32)
    for k in range(64):  # numpy rounds each operation to float32: no fused multiply-add
        expected[:, k] = q[:, k].numpy().astype(np.float32) * s32[:, k // 32] + m32[:, k // 32]
    assert torch.equal(got, torch.from_numpy(expected))
    q8 = torch.randint(-128, 128, (4, 64), generator=g, dtype=torch.int8)
    assert torch.equal(dequantize_int(q8, scales, None, 8, 32), q8.float() * scales.float().repeat_interleave(32, 1))


def test_fp8_blocks_may_overhang_the_weight():
    """ceil(N / bn) x ceil(K / bk) scales: the last block row and column cover what is left."""
    q = torch.randn(5, 7).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    w = dequantize_fp8(q, scales, (4, 4))
    block = torch.tensor([[1.0] * 4 + [2.0] * 3] * 4 + [[4.0] * 4 + [8.0] * 3])
    assert torch.equal(w, q.float() * block)


@pytest.mark.parametrize("bits,group_size,has_mins", [(4, 32, True), (8, 16, False)])
def test_a_layer_loads_the_layout_itself(bits, group_size, has_mins):
    from nanovllm.layers.linear import QKVParallelLinear, RowParallelLinear
    from nanovllm.utils.loader import process_weights_after_loading
    g = torch.Generator().manual_seed(2)
    spec = layout_spec(bits, group_size, has_mins)
    qkv = QKVParallelLinear(64, 16, 4, 2, quant_spec=spec, prefix="qkv")  # q 64, k 32, v 32 outputs
    row = RowParallelLinear(64, 64, bias=True, quant_spec=spec, prefix="o")
    parts = {}
    for layer, shard_id, n in [(qkv, "q", 64), (qkv, "k", 32), (qkv, "v", 32), (row, None, 64)]:
        q = torch.randint(0, 16, (n, 64), generator=g) if bits == 4 else torch.randint(-128, 128, (n, 64),
                                                                                        generator=g, dtype=torch.int8)
        tensors = dict(qweight=pack_int4(q) if bits == 4 else q, scales=torch.rand(n, 64 // group_size, generator=g))
        if has_mins:
            tensors["mins"] = -torch.rand(n, 64 // group_size, generator=g)
        for name, tensor in tensors.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor) if shard_id is None else param.weight_loader(param, tensor, shard_id)
        parts[shard_id] = dequantize_int(tensors["qweight"], tensors["scales"], tensors.get("mins"), bits, group_size)
    torch.nn.init.normal_(row.bias)
    model = torch.nn.ModuleList([qkv, row])
    process_weights_after_loading(model)
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(qkv(x), F.linear(x, torch.cat([parts["q"], parts["k"], parts["v"]])))
    residual = torch.randn(3, 64, generator=g)
    expected = residual + F.linear(x, parts[None], row.bias)
    assert torch.equal(row(x, residual.clone()), expected)


def test_layout_spec_refuses_what_the_layout_cannot_hold():
    with pytest.raises(ValueError, match="bits=3, group_size=32: the int layout holds 4 or 8 bits"):
        layout_spec(3, 32, True)
    with pytest.raises(ValueError, match="bits=4, group_size=12"):
        layout_spec(4, 12, True)


def test_int8_rows_are_rounded_a_chunk_at_a_time_with_the_same_result(monkeypatch):
    """quantize_rows_int8 converts HEAD_CHUNK_ROWS rows at a time (no float32 copy of a whole vocabulary): chunks
    of 3 rows, an all-zero row and a ragged last chunk give the whole-tensor rounding's bytes and scales."""
    from nanovllm.layers import embed_head
    w = torch.randn(10, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[4] = 0
    full_scales = w.float().abs().amax(1, keepdim=True) / 127
    full_scales = torch.where(full_scales > 0, full_scales, torch.ones_like(full_scales))
    full_q = torch.round(w.float() / full_scales).clamp(-127, 127).to(torch.int8)
    monkeypatch.setattr(embed_head, "HEAD_CHUNK_ROWS", 3)
    q, scales = embed_head.quantize_rows_int8(w)
    assert torch.equal(q, full_q) and torch.equal(scales, full_scales)
