"""`nanovllm convert --quantize` writes checkpoints in the published formats: read back here with the formats' own
published rules (written in this file, independently of the engine's readers), each value is within its format's
rounding of the float weight, and the engine runs the checkpoint exactly as the same model with those dequantized
weights in float32 (greedy, token-exact). GPTQ's rounding (--calibrate) lands on the same grid and lowers the
layer's output error.
"""
import json
import os

import pytest
import torch
from conftest import tiny_llm_kwargs
from safetensors.torch import load_file, save_file

from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints import cli
from nanovllm.utils.calibrate import SHARED_INPUT, gptq, inverse_factors
from nanovllm.utils.quantize import QUANTIZED_SUFFIXES, quantize_checkpoint, quantize_weight

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM pack order (nibble i of a word: output 8j + AWQ_ORDER[i])
PROMPTS = [[5, 17, 42, 99, 3], [250, 7, 7, 300, 12]]
# (--quantize, --group-size) for the tiny llama (hidden 64, kv projections of 32 rows)
FORMATS = [("fp8", 32), ("fp8-channel", 128), ("w4", 32), ("w4", 16)]


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM int32 [rows, N / 8] -> [rows, N] values 0..15."""
    nibbles = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [rows, N / 8, 8]
    out = torch.empty_like(nibbles)
    out[..., AWQ_ORDER] = nibbles
    return out.flatten(-2)


def dequantize_published(tensors: dict, prefix: str, fmt: str, group_size: int) -> torch.Tensor:
    """The float32 weight [N, K] of one layer in a written checkpoint, by the format's published rule."""
    if fmt == "w4":  # w = (q - z) * s, tensors stored [K, N / 8], [K / G, N / 8], [K / G, N]
        q = unpack_awq(tensors[f"{prefix}.qweight"]).t().float()
        z = unpack_awq(tensors[f"{prefix}.qzeros"]).t().float().repeat_interleave(group_size, 1)
        s = tensors[f"{prefix}.scales"].t().float().repeat_interleave(group_size, 1)
        return (q - z) * s
    q = tensors[f"{prefix}.weight"].float()
    if fmt == "fp8":  # weight_scale_inv [ceil(N / G), ceil(K / G)]
        s = tensors[f"{prefix}.weight_scale_inv"].repeat_interleave(group_size, 0).repeat_interleave(group_size, 1)
        return q * s[:q.size(0), :q.size(1)]
    return q * tensors[f"{prefix}.weight_scale"]  # per channel [N, 1]


def _linear_names(tensors: dict) -> list[str]:
    return sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith((".qweight", ".weight_scale_inv",
                                                                        ".weight_scale"))})


@pytest.mark.parametrize("fmt,group_size", FORMATS)
def test_written_values_are_within_the_formats_rounding(llama_dir, tmp_path, fmt, group_size):
    out = quantize_checkpoint(llama_dir, str(tmp_path / "q"), fmt, group_size)
    original = {}
    for name in sorted(os.listdir(llama_dir)):
        if name.endswith(".safetensors"):
            original.update(load_file(os.path.join(llama_dir, name)))
    written = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            written.update(load_file(os.path.join(out, name)))
    names = _linear_names(written)
    assert len(names) == 2 * 7  # every q/k/v/o/gate/up/down of both layers, nothing else
    assert torch.equal(written["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
    for prefix in names:
        w = original[f"{prefix}.weight"].float()
        got = dequantize_published(written, prefix, fmt, group_size)
        if fmt == "w4":  # within half a step of the group's grid: (max - min) / 15 / 2 (+ fp16 scale rounding)
            groups = w.reshape(w.size(0), -1, group_size)
            half_step = ((groups.amax(-1) - groups.amin(-1)) / 30).repeat_interleave(group_size, 1)
            assert ((got - w).abs() <= half_step * 1.05).all(), prefix
        else:  # e4m3 keeps 3 mantissa bits: within 2**-4 of each value; subnormals within half their step
            subnormal_step = w.abs().max() / 448 * 2 ** -9
            assert ((got - w).abs() <= w.abs() * 2 ** -4 + subnormal_step / 2).all(), prefix
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["quantization_config"]["quant_method"] == {"fp8": "fp8", "w4": "awq"}.get(fmt, "compressed-tensors")
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))  # the source's two shards, kept


def _reference(src: str, out: str, fmt: str, group_size: int, directory: str) -> str:
    """The same model with the written weights dequantized to float32, as an ordinary checkpoint."""
    tensors = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(out, name)))
    weights = {n: t for n, t in tensors.items() if n.rsplit(".", 1)[0] not in _linear_names(tensors)}
    for prefix in _linear_names(tensors):
        weights[f"{prefix}.weight"] = dequantize_published(tensors, prefix, fmt, group_size).contiguous()
    os.makedirs(directory)
    save_file(weights, os.path.join(directory, "model.safetensors"))
    config = json.load(open(os.path.join(src, "config.json")))
    json.dump(config, open(os.path.join(directory, "config.json"), "w"))
    return directory


@pytest.mark.parametrize("fmt,group_size", [("fp8", 32), ("w4", 16)])
def test_the_engine_runs_a_written_checkpoint_as_its_dequantized_weights(llama_dir, tmp_path, fmt, group_size):
    out = quantize_checkpoint(llama_dir, str(tmp_path / "q"), fmt, group_size)
    reference = _reference(llama_dir, out, fmt, group_size, str(tmp_path / "reference"))
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(out, **tiny_llm_kwargs()) as llm:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(reference, **tiny_llm_kwargs()) as llm:
        want = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]


@pytest.mark.parametrize("fmt", ["w4", "fp8"])
def test_gptq_lands_on_the_grid_and_lowers_the_output_error(fmt):
    """Inputs with correlated channels (as a layer's activations are): GPTQ's weights sit on the format's grid (the
    written codes give them back exactly) and X @ W.T moves less than with round-to-nearest."""
    torch.manual_seed(0)
    n, k, group = 64, 256, 32
    mix = torch.randn(k, k) / k ** 0.5 + torch.eye(k)
    x = torch.randn(2048, k) @ mix  # [tokens, K]
    hessian = x.T @ x / x.size(0)
    w = torch.randn(n, k) * 0.05
    errors = {}
    for name, h in (("rtn", None), ("gptq", hessian)):
        tensors = quantize_weight("l.q_proj.weight", w, fmt, group, h)
        got = dequantize_published(tensors, "l.q_proj", fmt, group)
        errors[name] = ((x @ (got - w).T) ** 2).mean().item()
    assert errors["gptq"] < 0.8 * errors["rtn"]


def test_gptq_keeps_a_weight_that_is_on_the_grid():
    """Every group spans codes 0..15 with zero 8 and a step of 2**-7 (exact in fp16): nothing to round, no error to
    push, so GPTQ returns the weight itself."""
    from nanovllm.utils.quantize import _fit_awq, _round_awq
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (16, 64))
    codes[:, ::32], codes[:, 1::32] = 0, 15
    w = (codes - 8).float() * 2 ** -7
    x = torch.randn(512, 64)
    got, params = gptq(w, x.T @ x, 32, _fit_awq, _round_awq)
    assert torch.equal(got, w)
    assert all(torch.equal(scale, torch.full((16,), 2 ** -7)) and torch.equal(zero, torch.full((16,), 8.0))
               for scale, zero in params)


def _load_dir(directory: str) -> dict:
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(directory, name)))
    return tensors


@pytest.mark.parametrize("fmt,group_size", [("fp8", 32), ("fp8-channel", 128), ("w4", 16)])
def test_weights_that_share_a_hessian_are_rounded_as_each_alone(llama_dir, tmp_path, monkeypatch, fmt, group_size):
    """quantize_checkpoint runs GPTQ once over the weights that share a Hessian (q/k/v, gate/up: one input),
    stacked, and over alike layers at once (gptq_batch); every tensor it writes, with the Hessians' factors given
    or not, is bit for bit that weight's quantize_weight alone (GPTQ's grid and updates are each row's own given H)."""
    from nanovllm.utils import calibrate
    batches, gptq_batch = [], calibrate.gptq_batch
    monkeypatch.setattr(calibrate, "gptq_batch", lambda ws, *args: (batches.append([w.shape for w in ws]),
                                                                      gptq_batch(ws, *args))[1])
    torch.manual_seed(0)
    original, hessians, by_input = _load_dir(llama_dir), {}, {}
    for name in sorted(n for n in original if n.endswith(QUANTIZED_SUFFIXES)):
        prefix, leaf = name.removesuffix(".weight").rsplit(".", 1)
        source, k = f"{prefix}.{SHARED_INPUT.get(leaf, leaf)}", original[name].size(1)
        if source not in by_input:  # correlated channels, as a layer's inputs have
            x = torch.randn(256, k) @ (torch.randn(k, k) / k ** 0.5 + torch.eye(k))
            by_input[source] = x.T @ x / x.size(0)
        hessians[name] = by_input[source]
    assert len(by_input) == 4 * 2 < len(hessians)  # q/k/v and gate/up share one per layer
    written = [_load_dir(quantize_checkpoint(llama_dir, str(tmp_path / str(i)), fmt, group_size, hessians, factors))
               for i, factors in enumerate((None, inverse_factors(hessians)))]
    assert max(len(shapes) for shapes in batches) == 2  # both layers' projection in one loop
    assert max(shapes[0][0] for shapes in batches) == 2 * original["model.layers.0.mlp.up_proj.weight"].size(0)
    for name, hessian in hessians.items():
        for key, want in quantize_weight(name, original[name], fmt, group_size, hessian).items():
            for got in written:
                assert torch.equal(got[key].view(torch.uint8), want.view(torch.uint8)), key


def test_cli_names_a_group_size_that_does_not_divide_a_layer(llama_dir, tmp_path, capsys):
    code = cli.main(["convert", str(tmp_path / "q"), "--model", llama_dir, "--quantize", "w4", "--group-size", "48"])
    err = capsys.readouterr().err
    assert code == 2 and "--group-size 48 does not divide model.layers.0." in err and "e.g. 64" in err
    assert not os.path.exists(tmp_path / "q")


def test_cli_quantizes_a_sharded_checkpoint_and_never_replaces_other_files(llama_dir, tmp_path, capsys):
    """The tiny Llama is two shards without tokenizer files: the quantized checkpoint keeps them so. An output
    directory holding a checkpoint is replaced only with --force; one holding anything else, or the source itself,
    is refused."""
    out = tmp_path / "q"
    args = ["convert", str(out), "--model", llama_dir, "--quantize", "w4", "--group-size", "32"]
    assert cli.main(args) == 0
    assert (out / "model.safetensors.index.json").exists() and not (out / "tokenizer.json").exists()
    assert cli.main(args) == 2 and "already holds a checkpoint; pass --force" in capsys.readouterr().err
    assert cli.main([*args, "--force"]) == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert cli.main(["convert", str(mine), *args[2:]]) == 2
    assert "holds files that are not a finished checkpoint" in capsys.readouterr().err
    assert os.listdir(mine) == ["notes.txt"]
    assert cli.main(["convert", llama_dir, *args[2:], "--force"]) == 2
    assert "is --model" in capsys.readouterr().err
    assert "quantization_config" not in json.load(open(os.path.join(llama_dir, "config.json")))  # the source kept
