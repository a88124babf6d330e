"""GGUF tensors read into the engine's "int" layout equal the `gguf` package's own dequantization.

Each test writes a small GGUF with the gguf package's GGUFWriter: Q4_0, Q4_1 and Q8_0 blocks made by
gguf.quants.quantize, and for every type (the K-quants, which gguf-py cannot quantize, included) blocks of random
bytes laid out as ggml-common.h publishes them, with finite fp16 scales. The engine's reference dequantization of
what the loader returns is compared with gguf.quants.dequantize of the file's bytes.
"""
import gguf
import numpy as np
import pytest
import torch
from gguf_factories import FP16_FIELDS, QUANTIZABLE, T, llama_cpp_permute, random_blocks, write_gguf

from nanovllm.layers.quantization.layout import dequantize_int
from nanovllm.utils.gguf_blocks import IntGroups
from nanovllm.utils.gguf_loader import iter_gguf_tensors
from nanovllm.utils.gguf_model import gguf_tensor_types, open_gguf

N, K = 24, 512  # K: two K-quant super-blocks of 256 per row


def engine_dequantize(value) -> np.ndarray:
    if isinstance(value, IntGroups):
        return dequantize_int(value.qweight, value.scales, value.mins, value.bits, value.group_size).numpy()
    return value.to(torch.float32).numpy()


def assert_same_floats(got: np.ndarray, want: np.ndarray):
    """Equal bit for bit, except that a zero's sign may differ: Q4_0's `d * (q - 8)` gives -0.0 for a negative d
    where the layout's `q * d + (-8 * d)` gives +0.0 (equal numbers; no matmul tells them apart)."""
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    same_bits = got.view(np.int32) == want.view(np.int32)
    both_zero = (got == 0) & (want == 0)
    assert (same_bits | both_zero).all(), f"{(~(same_bits | both_zero)).sum()} values differ"


def read_back(path: str) -> dict:
    reader = open_gguf(path)
    raw = {t.name: (t.data, t.tensor_type) for t in reader.tensors}
    return raw, dict(iter_gguf_tensors(reader))


@pytest.mark.parametrize("type_name", list(FP16_FIELDS))
def test_random_blocks_equal_gguf_dequantize(tmp_path, type_name):
    rng = np.random.default_rng(sum(map(ord, type_name)))
    blocks = random_blocks(type_name, N, K, rng)
    path = write_gguf(str(tmp_path / "m.gguf"), "qwen3", {"blk.0.ffn_up.weight": (blocks, type_name)})
    raw, loaded = read_back(path)
    got = loaded["model.layers.0.mlp.up_proj.weight"]
    assert isinstance(got, IntGroups) and got.shape == (N, K)
    data, qtype = raw["blk.0.ffn_up.weight"]
    assert_same_floats(engine_dequantize(got), gguf.quants.dequantize(data, qtype))


@pytest.mark.parametrize("type_name", QUANTIZABLE)
def test_quantized_by_gguf_equal_gguf_dequantize(tmp_path, type_name):
    weights = np.random.default_rng(1).standard_normal((N, K)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, getattr(T, type_name))
    path = write_gguf(str(tmp_path / "m.gguf"), "qwen3", {"blk.3.attn_output.weight": (blocks, type_name)})
    raw, loaded = read_back(path)
    data, qtype = raw["blk.3.attn_output.weight"]
    assert_same_floats(engine_dequantize(loaded["model.layers.3.self_attn.o_proj.weight"]),
                       gguf.quants.dequantize(data, qtype))


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
def test_float_tensors_keep_their_dtype_and_bits(tmp_path, type_name):
    weights = np.random.default_rng(2).standard_normal((N, 64)).astype(np.float32)
    data = gguf.quants.quantize(weights, getattr(T, type_name))
    path = write_gguf(str(tmp_path / "m.gguf"), "qwen3", {"blk.0.ffn_down.weight": (data, type_name),
                                                           "output_norm.weight": (weights[0], "F32")})
    raw, loaded = read_back(path)
    got = loaded["model.layers.0.mlp.down_proj.weight"]
    assert got.dtype == {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
    assert_same_floats(got.float().numpy(), gguf.quants.dequantize(*raw["blk.0.ffn_down.weight"]))
    assert torch.equal(loaded["model.norm.weight"], torch.from_numpy(weights[0]))


@pytest.mark.parametrize("arch,permuted", [("llama", True), ("qwen2", False)])
def test_llama_qk_rows_come_back_in_hugging_face_order(tmp_path, arch, permuted):
    """A llama GGUF's q and k rows (weights quantized, biases float) are un-permuted exactly; qwen2's are not."""
    rng = np.random.default_rng(3)
    head_dim = 16
    hf = {"q": rng.standard_normal((4 * head_dim, 64)).astype(np.float32),
          "k": rng.standard_normal((2 * head_dim, 64)).astype(np.float32)}
    bias = {"q": rng.standard_normal(4 * head_dim).astype(np.float32)}
    heads = {"q": 4, "k": 2}
    stored = {p: llama_cpp_permute(w, heads[p]) if permuted else w for p, w in hf.items()}
    tensors = {f"blk.0.attn_{p}.weight": (gguf.quants.quantize(w, T.Q4_1), "Q4_1") for p, w in stored.items()}
    tensors["blk.0.attn_q.bias"] = (llama_cpp_permute(bias["q"], 4) if permuted else bias["q"], "F32")
    raw, loaded = read_back(write_gguf(str(tmp_path / "m.gguf"), arch, tensors))
    for p in ("q", "k"):
        got = engine_dequantize(loaded[f"model.layers.0.self_attn.{p}_proj.weight"])
        file_order = gguf.quants.dequantize(*raw[f"blk.0.attn_{p}.weight"])
        assert_same_floats(llama_cpp_permute(got, heads[p]) if permuted else got, file_order)
    assert torch.equal(loaded["model.layers.0.self_attn.q_proj.bias"], torch.from_numpy(bias["q"]))


def test_unknown_tensor_and_truncated_file_are_named(tmp_path):
    path = write_gguf(str(tmp_path / "a.gguf"), "llama", {"rope_freqs.weight": (np.ones(8, np.float32), "F32")})
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        gguf_tensor_types(open_gguf(path))
    weights = gguf.quants.quantize(np.ones((16, 64), np.float32), T.Q8_0)
    path = write_gguf(str(tmp_path / "b.gguf"), "qwen3", {"blk.0.ffn_up.weight": (weights, "Q8_0")})
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(ValueError, match="b.gguf.* is truncated or corrupt"):
        open_gguf(path)
    # a quantized 1-D tensor (llama.cpp keeps norms in float): its error names it
    norm = gguf.quants.quantize(np.ones(64, np.float32), T.Q8_0)
    path = write_gguf(str(tmp_path / "c.gguf"), "llama", {"blk.0.attn_norm.weight": (norm, "Q8_0")})
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_norm.weight': .*not whole blocks"):
        list(iter_gguf_tensors(open_gguf(path)))


def test_a_gguf_files_disk_tier_identity_follows_its_bytes_not_its_place(tmp_path):
    """The disk tier names a model's KV blocks by the model's identity: for a GGUF (no config.json), its bytes."""
    import shutil

    from nanovllm_offload.disk_fingerprint import model_identity
    blocks = random_blocks("Q8_0", N, K, np.random.default_rng(5))
    a = write_gguf(str(tmp_path / "a.gguf"), "qwen3", {"blk.0.ffn_up.weight": (blocks, "Q8_0")})
    same = shutil.copy(a, tmp_path / "same.gguf")
    blocks[3, 7] ^= 1  # one bit of one weight
    tuned = write_gguf(str(tmp_path / "tuned.gguf"), "qwen3", {"blk.0.ffn_up.weight": (blocks, "Q8_0")})
    assert model_identity(a) == model_identity(str(same)) != model_identity(tuned)
