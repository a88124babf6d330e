"""Quantized checkpoints (AWQ, GPTQ, compressed-tensors, FP8), each written by tests/quant_checkpoints.py the way
the format's own tools pack it: the engine's logits match HF transformers running the same model with the weights
dequantized in float32 (TOLERANCE), greedy output is token-exact against it, and tensor parallelism shards the
packed weights on group boundaries."""
import multiprocessing as mp
import os

import pytest
import torch

import quant_checkpoints as qc
from conftest import VOCAB, assert_matches_hf, close_llm, greedy, random_prompts, tiny_llm_kwargs
from nanovllm import LLM

TOLERANCE = 1e-4  # absolute, in nats: the engine's float32 logprobs against HF's float32 on the dequantized weights
PROMPTS = random_prompts([5, 19, 33])
MAX_TOKENS = 8
NUM_TOP = 3


def _row_groups(fn):
    """A quantizer for group_size -1: one group per row, whatever the layer's K."""
    return lambda name, w: fn(w, w.shape[1])


# id -> (base model, quantize(name, w) -> (tensors, deq), quantization_config, tensor renames, extra tensors)
CASES = {
    "awq-g32": ("qwen3", lambda n, w: qc.awq_linear(w, 32), qc.awq_config(32), None, None),
    "awq-g64": ("llama", lambda n, w: qc.awq_linear(w, 64), qc.awq_config(64), None, None),
    # the second layer's MLP left in float32 (AutoAWQ's modules_to_not_convert)
    "awq-g32-skip": ("qwen3", lambda n, w: None if ".layers.1.mlp." in n else qc.awq_linear(w, 32),
                     dict(qc.awq_config(32), modules_to_not_convert=["model.layers.1.mlp"]), None, None),
    "awq-g32-qwen2": ("qwen2", lambda n, w: qc.awq_linear(w, 32), qc.awq_config(32), None, None),
    "gptq4-sym-g32": ("qwen3", lambda n, w: qc.gptq_linear(w, 32, 4, True), qc.gptq_config(4, 32, True), None, None),
    "gptq8-asym-g64": ("llama", lambda n, w: qc.gptq_linear(w, 64, 8, False), qc.gptq_config(8, 64, False), None,
                       None),
    "gptq4-asym-rows": ("llama", _row_groups(lambda w, g: qc.gptq_linear(w, g, 4, False)),
                        qc.gptq_config(4, -1, False), None, None),
    "ct-w4-sym-g32": ("qwen3", lambda n, w: qc.ct_int_linear(w, 32, 4, True),
                      qc.ct_config("pack-quantized", qc.ct_int_weights(4, 32, True)), None, None),
    "ct-w4-asym-g64": ("llama", lambda n, w: qc.ct_int_linear(w, 64, 4, False),
                       qc.ct_config("pack-quantized", qc.ct_int_weights(4, 64, False)), None, None),
    "fp8-block128": ("qwen3", lambda n, w: qc.fp8_linear(w, (128, 128)), qc.fp8_config([128, 128]),
                     {"weight_scale": "weight_scale_inv"}, None),
    "fp8-block32": ("llama", lambda n, w: qc.fp8_linear(w, (32, 32)), qc.fp8_config([32, 32]),
                    {"weight_scale": "weight_scale_inv"}, None),
    "ct-fp8-channel": ("qwen3", lambda n, w: qc.fp8_linear(w, None),
                       qc.ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "channel",
                                                        "symmetric": True, "dynamic": False},
                                    {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
                       None, None),
    "ct-fp8-block64": ("qwen3", lambda n, w: qc.fp8_linear(w, (64, 64)),
                       qc.ct_config("float-quantized", {"num_bits": 8, "type": "float", "strategy": "block",
                                                        "block_structure": [64, 64], "symmetric": True,
                                                        "dynamic": False}), None, None),
    # per-tensor scales (q, k and v each their own) and static activation scales, which weight-only compute skips
    "fp8-tensor-static": ("llama", lambda n, w: qc.fp8_linear(w, None, per_tensor=True),
                          qc.fp8_config(None, "static"), None,
                          lambda layer: {f"{layer}.input_scale": torch.tensor(0.02)}),
}


def quant_pair(quant_root, bases, case: str) -> tuple[str, str]:
    path = str(quant_root / case)
    if not os.path.isdir(path):
        base, quantize, config, rename, extra = CASES[case]
        qc.write_pair(bases[base], path, quantize, config, rename, extra)
    return os.path.join(path, "quantized"), os.path.join(path, "reference")


def hf_log_softmax(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].log_softmax(-1)


def run(model_dir: str, prompts=PROMPTS, **overrides):
    llm = LLM(model_dir, **tiny_llm_kwargs(**overrides))
    try:
        return llm.generate(prompts, greedy(MAX_TOKENS, prompt_logprobs=NUM_TOP), use_tqdm=False)
    finally:
        close_llm(llm)


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_matches_its_dequantized_weights(quant_root, bases, case):
    quant_dir, ref_dir = quant_pair(quant_root, bases, case)
    outs = run(quant_dir)
    assert_matches_hf(ref_dir, PROMPTS, outs, MAX_TOKENS, case)
    for prompt, out in zip(PROMPTS, outs):
        reference = hf_log_softmax(ref_dir, prompt)  # row j predicts token j + 1
        for j in range(1, len(prompt)):
            entry = out["prompt_logprobs"][j]
            got = entry[prompt[j]].logprob
            assert abs(got - reference[j - 1, prompt[j]].item()) < TOLERANCE, (case, j, got)
            top = sorted((v.logprob for v in entry.values() if v.rank <= NUM_TOP), reverse=True)
            expected = reference[j - 1].topk(NUM_TOP).values.tolist()
            assert max(abs(a - b) for a, b in zip(top, expected)) < TOLERANCE, (case, j, top, expected)


@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
@pytest.mark.parametrize("case,head", [("awq-g32", "int8"), ("gptq8-asym-g64", None), ("fp8-block32", "int8")])
def test_tp2_shards_packed_weights_like_tp1(quant_root, bases, case, head):
    """Column-parallel layers split N, row-parallel ones K in whole groups (4 x 32-groups of o_proj's 128 inputs
    per rank at G=32; one 64-group at G=64); with the int8 head (tied on Qwen3, untied on Llama) each rank rounds
    its own vocabulary rows. TP=2 greedy equals TP=1's."""
    quant_dir, _ = quant_pair(quant_root, bases, case)
    ref = [o["token_ids"] for o in run(quant_dir, quantize_lm_head=head)]
    got = [o["token_ids"] for o in run(quant_dir, quantize_lm_head=head, tensor_parallel_size=2)]
    assert got == ref
    assert mp.active_children() == []


def test_quantization_option_follows_or_checks_the_checkpoint(quant_root, bases):
    quant_dir, ref_dir = quant_pair(quant_root, bases, "awq-g32")
    from nanovllm.config import Config
    assert Config(quant_dir, quantization="awq").quant_spec.method == "awq"
    assert Config(quant_dir, quantization="auto").quant_spec.group_size == 32
    assert Config(ref_dir).quant_spec is None
    with pytest.raises(ValueError, match=r"quantization='gptq' disagrees .*quant_method='awq'"):
        Config(quant_dir, quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization='fp8' but the checkpoint has no quantization_config"):
        Config(ref_dir, quantization="fp8")
    with pytest.raises(ValueError, match=r"quantization='int3' must be None, 'auto' or one of"):
        Config(quant_dir, quantization="int3")


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """Symmetric int8 per vocabulary row (scale max|row| / 127), dequantized in float32: the reference of
    quantize_lm_head="int8"."""
    scale = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("kind", ["qwen3", "llama"])  # tied: one int8 tensor serves both; untied: each its own
def test_int8_lm_head_matches_its_dequantized_weights(quant_root, bases, kind):
    from safetensors.torch import load_file, save_file
    ref_dir = quant_root / f"int8-head-{kind}"
    if not ref_dir.is_dir():
        ref_dir.mkdir()
        tensors = load_file(os.path.join(bases[kind], "model.safetensors"))
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in tensors:
                tensors[name] = int8_rows(tensors[name])
        save_file(tensors, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
        (ref_dir / "config.json").write_text(open(os.path.join(bases[kind], "config.json")).read())
    llm = LLM(bases[kind], **tiny_llm_kwargs(quantize_lm_head="int8"))
    try:
        outs = llm.generate(PROMPTS, greedy(MAX_TOKENS, prompt_logprobs=NUM_TOP), use_tqdm=False)
        head = llm.runner.model.lm_head
        assert head.weight.dtype == torch.int8 and head.scales.shape == (VOCAB, 1)
        assert (head.weight is llm.runner.model.model.embed_tokens.weight) == (kind == "qwen3")
    finally:
        close_llm(llm)
    assert_matches_hf(str(ref_dir), PROMPTS, outs, MAX_TOKENS, kind)
    for prompt, out in zip(PROMPTS, outs):
        reference = hf_log_softmax(str(ref_dir), prompt)
        for j in range(1, len(prompt)):
            got = out["prompt_logprobs"][j][prompt[j]].logprob
            assert abs(got - reference[j - 1, prompt[j]].item()) < TOLERANCE, (kind, j, got)
