"""Quantized checkpoints the engine cannot run: one ValueError naming the field, its value and what is supported,
before any weight is read (the checkpoints here hold a file that is not safetensors, so reading one would fail
otherwise); a tensor no parameter takes, or of the wrong size or dtype, names the tensor."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_checkpoints as qc
from conftest import close_llm, tiny_llm_kwargs
from nanovllm import LLM
from test_quant_formats import quant_pair


def unreadable_checkpoint(tmp_path, base_dir: str, quantization_config: dict) -> str:
    """base_dir's config.json with quantization_config, beside a model.safetensors that is not one."""
    with open(os.path.join(base_dir, "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    return str(tmp_path)


def start(model_dir: str, **overrides):
    close_llm(LLM(model_dir, **tiny_llm_kwargs(**overrides)))


def ct_groups(**weights) -> dict:
    return qc.ct_config("pack-quantized", {**qc.ct_int_weights(4, 32, True), **weights})


# config -> the error's words (field=value ... supported); the tiny llama's layers take 128 or 256 inputs, its k and v
# parts have 64 outputs
UNSUPPORTED = [
    (qc.gptq_config(3, 32, True), r"quantization_config.bits=3 is not supported; supported: \[4, 8\]"),
    (dict(qc.gptq_config(4, 32, True), desc_act=True),
     r"quantization_config.desc_act=True is not supported; supported: \[False, None\]"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     r"quant_method='bitsandbytes' is not supported; supported: \['awq', 'gptq', 'compressed-tensors', 'fp8'\]"),
    (qc.awq_config(48), r"quantization_config.group_size=48 does not divide qkv_proj's input size 128"),
    (qc.awq_config(12), r"quantization_config.group_size=12 is not supported; supported: a positive int multiple of 8"),
    (dict(qc.awq_config(32), version="gemv"), r"quantization_config.version='gemv' is not supported"),
    (dict(qc.awq_config(32), bits=3), r"quantization_config.bits=3 is not supported; supported: \[4\]"),
    (ct_groups(actorder="group"), r"weights.actorder='group' is not supported; supported: \[None, False\]"),
    (ct_groups(num_bits=2), r"weights.num_bits=2 is not supported; supported: \[4, 8\]"),
    (qc.fp8_config([128, 128]),
     r"quantization_config.weight_block_size=\[128, 128\]: qkv_proj's output part of 64 .* is not a multiple of 128"),
    (dict(qc.fp8_config(None), fmt="e5m2"), r"quantization_config.fmt='e5m2' is not supported; supported: \['e4m3'\]"),
    # fields that change what the weights mean: loaded as if unset, the model would compute something else
    (dict(qc.gptq_config(4, 32, True), lm_head=True), r"quantization_config.lm_head=True is not supported"),
    (dict(qc.gptq_config(4, 32, True), dynamic={"-:.*mlp.*": {}}), r"quantization_config.dynamic=.* is not supported"),
    (dict(ct_groups(), transform_config={"config_groups": {"u": {"type": "hadamard"}}}),
     r"quantization_config.transform_config=.* is not supported; supported: null"),
    (dict(ct_groups(), sparsity_config={"format": "sparse-24-bitmask"}), r"quantization_config.sparsity_config="),
    (ct_groups(dynamic=True), r"config_groups.group_0.weights.dynamic=True is not supported"),
    # malformed values: a ValueError naming the field, not a TypeError or ZeroDivisionError from deeper down
    (["awq"], r"quantization_config=\['awq'\] must be a JSON object"),
    (qc.fp8_config([True, True]), r"weight_block_size=\[True, True\] is not supported"),
    (qc.ct_config("float-quantized", {"type": "float", "num_bits": 8, "strategy": "block",
                                      "block_structure": [0, 128]}),
     r"weights.block_structure=\[0, 128\] is not supported; supported: \[bn, bk\] of two positive ints"),
    (qc.ct_config("float-quantized", {"type": "float", "num_bits": 8, "strategy": "block",
                                      "block_structure": ["a", 128]}), r"weights.block_structure=\['a', 128\]"),
]


@pytest.mark.parametrize("config,error", UNSUPPORTED, ids=[e.split(" ")[0][:40] for _, e in UNSUPPORTED])
def test_unsupported_quantization_config_is_one_value_error_before_loading(tmp_path, bases, config, error):
    model_dir = unreadable_checkpoint(tmp_path, bases["llama"], config)
    with pytest.raises(ValueError, match=error):
        start(model_dir)


@pytest.mark.parametrize("config", [qc.awq_config(128), qc.gptq_config(4, -1, True)], ids=["g128", "per-row"])
def test_row_parallel_shard_must_hold_whole_groups(tmp_path, bases, config):
    """o_proj's 128 inputs split in two are 64 per rank: groups of 128 (or one per row) would straddle the ranks."""
    model_dir = unreadable_checkpoint(tmp_path, bases["llama"], config)
    with pytest.raises(ValueError, match=rf"group_size={config['group_size']} does not divide o_proj's input size "
                                         r"64 .*tensor_parallel_size=2"):
        start(model_dir, tensor_parallel_size=2)


def test_block_fp8_without_quantization_config_is_refused(quant_root, bases, tmp_path):
    """The issue's report: Qwen's block-FP8 layout with its quantization_config missing must not load as if the
    e4m3 values were unscaled weights."""
    quant_dir, _ = quant_pair(quant_root, bases, "fp8-block128")
    shutil.copytree(quant_dir, tmp_path / "ckpt")
    config_path = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(float8_e4m3fn does not match the parameter's torch.float32|"
                                         r"weight_scale_inv).* quantization_config"):
        start(str(tmp_path / "ckpt"))


def rewrite(src_dir: str, dst, change) -> str:
    """A copy of a checkpoint whose tensors pass through change(dict) first."""
    shutil.copytree(src_dir, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    change(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_a_tensor_no_parameter_takes_is_an_error(quant_root, bases, tmp_path):
    quant_dir, _ = quant_pair(quant_root, bases, "awq-g32")
    extra = rewrite(quant_dir, tmp_path / "extra",
                    lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(128, 256)}))
    with pytest.raises(ValueError, match=r"no parameter of the model takes tensor 'model.layers.0.mlp.down_proj.weight'"
                                         r" \(quantization_config.quant_method='awq'"):
        start(extra)
    # rotary tables the engine computes itself are the known exception
    harmless = rewrite(quant_dir, tmp_path / "harmless",
                       lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(32)}))
    start(harmless)


@pytest.mark.parametrize("case,tensor,change,error", [
    ("awq-g32", "model.layers.0.self_attn.q_proj.qweight", lambda t: t[:, :-1].contiguous(),
     r"shape \(128, 31\) does not match the parameter's \(128, 32\)"),
    ("awq-g32", "model.layers.1.mlp.down_proj.scales", lambda t: t.float(),
     None),  # a float32 scale is exact: accepted
    ("awq-g32", "model.layers.0.mlp.up_proj.qweight", lambda t: t.float(),
     r"dtype torch.float32 does not match the parameter's torch.int32"),
    ("gptq4-sym-g32", "model.layers.0.mlp.gate_proj.g_idx", lambda t: t.flip(0).contiguous(),
     r"g_idx .* is not k // group_size .* desc_act=true"),
    ("gptq4-sym-g32", "model.layers.0.mlp.gate_proj.g_idx", lambda t: (torch.arange(len(t)) // 16).to(t.dtype),
     r"g_idx groups every 16 inputs, but quantization_config.group_size=32"),  # not act-order: the wrong size
    ("ct-w4-sym-g32", "model.layers.0.self_attn.k_proj.weight_shape", lambda t: t + 1,
     r"weight_shape \[129, 129\] does not match the layer's \[128, 128\]"),
    ("fp8-block128", "model.layers.0.self_attn.o_proj.weight_scale_inv", lambda t: t[:, :1].contiguous(),
     r"shape \(1, 1\) does not match the parameter's \(1, 2\)"),
    ("fp8-block128", "model.layers.0.self_attn.o_proj.weight_scale_inv", lambda t: t.fill_(float("nan")),
     r"2 of its values are NaN or infinite"),  # it once loaded and generated token 0 forever
    ("awq-g32", "model.layers.1.mlp.down_proj.scales", lambda t: t.index_fill(0, torch.tensor([0]), float("inf")),
     r"\d+ of its values are NaN or infinite"),
])
def test_a_corrupt_tensor_names_itself(quant_root, bases, tmp_path, case, tensor, change, error):
    quant_dir, _ = quant_pair(quant_root, bases, case)

    def corrupt(tensors):
        tensors[tensor] = change(tensors[tensor])
    bad = rewrite(quant_dir, tmp_path / "bad", corrupt)
    if error is None:
        start(bad)
        return
    with pytest.raises(ValueError, match=rf"weight '{tensor}': {error}"):
        start(bad)


def test_a_merged_layer_partly_left_unquantized_is_refused(tmp_path, bases):
    config = dict(qc.awq_config(32), modules_to_not_convert=["q_proj"])
    model_dir = unreadable_checkpoint(tmp_path, bases["llama"], config)
    with pytest.raises(ValueError, match=r"leaves \['model.layers.0.self_attn.q_proj', .*\] partly unquantized"):
        start(model_dir)


def test_gptq_without_g_idx_loads(quant_root, bases, tmp_path):
    """g_idx is optional (without act-order it says nothing the group size does not); every other tensor is not."""
    quant_dir, _ = quant_pair(quant_root, bases, "gptq4-sym-g32")

    def drop(names):
        def change(tensors):
            for name in [n for n in tensors if n.endswith(names)]:
                del tensors[name]
        return change
    start(rewrite(quant_dir, tmp_path / "no-g-idx", drop(".g_idx")))
    with pytest.raises(ValueError, match=r"lacks weights for \['model.layers.0.mlp.down_proj.qzeros'"):
        start(rewrite(quant_dir, tmp_path / "no-qzeros", drop("down_proj.qzeros")))
