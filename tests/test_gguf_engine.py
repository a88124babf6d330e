"""A GGUF model runs natively (LLM(model="file.gguf")): its weights stay in the int layout, and it generates exactly
what the same model generates with its weights dequantized to float32 (fp32 activations, greedy).

- a tiny llama GGUF mixing every supported block type the way a Q4_K_M file does (q and k in one type, v in
  another, inside one merged qkv layer), written by the test with random blocks; its reference is a safetensors
  checkpoint of gguf.quants.dequantize's weights, q/k rows put back in Hugging Face's order by the test's own
  inverse of llama.cpp's permutation;
- SmolLM2-135M-Instruct from its Q4_1 GGUF against the float32 checkpoint transformers converts from it.
"""
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf_factories import hf_order, random_blocks, write_gguf
from safetensors.torch import save_file

from nanovllm import LLM, SamplingParams

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 512  # K-quants need inputs in whole super-blocks of 256
HEAD_DIM = HIDDEN // HEADS
# block types of (q, k, v, o, gate, up, down) per layer: merged layers whose parts differ (qkv: 4-bit groups of 32
# with 8-bit groups of 16, and with 8-bit groups of 32; gate_up: Q4_0 with Q4_1), every type in a layer of its own
LAYER_TYPES = [("Q4_K", "Q4_K", "Q6_K", "Q4_0", "Q5_K", "Q5_K", "Q8_0"),
               ("Q4_1", "Q4_1", "Q8_0", "Q6_K", "Q4_0", "Q4_1", "Q4_K")]
PARTS = {  # GGUF name -> (Hugging Face name, [rows, cols])
    "attn_q": ("self_attn.q_proj", [HEADS * HEAD_DIM, HIDDEN]),
    "attn_k": ("self_attn.k_proj", [KV_HEADS * HEAD_DIM, HIDDEN]),
    "attn_v": ("self_attn.v_proj", [KV_HEADS * HEAD_DIM, HIDDEN]),
    "attn_output": ("self_attn.o_proj", [HIDDEN, HEADS * HEAD_DIM]),
    "ffn_gate": ("mlp.gate_proj", [FFN, HIDDEN]),
    "ffn_up": ("mlp.up_proj", [FFN, HIDDEN]),
    "ffn_down": ("mlp.down_proj", [HIDDEN, FFN]),
}
METADATA = {"add_context_length": 256, "add_embedding_length": HIDDEN, "add_block_count": len(LAYER_TYPES),
            "add_feed_forward_length": FFN, "add_head_count": HEADS, "add_head_count_kv": KV_HEADS,
            "add_rope_freq_base": 10000.0, "add_layer_norm_rms_eps": 1e-5, "add_vocab_size": VOCAB}
PROMPTS = [[5, 17, 42, 99, 3], [250, 7, 7, 300, 12, 480, 1, 64]]
# the weights are the same float32 numbers; a quantized o_proj/down_proj adds its product to the residual after the
# matmul (one rounding more than the plain layer's fused addmm), so logprobs agree to float32 rounding, not bits
LOGPROB_TOLERANCE = 1e-5
ENGINE = dict(device="cpu", dtype="float32", num_kvcache_blocks=16, kvcache_block_size=16, swap_space=0,
              enforce_eager=True)


def _tiny_tensors(rng) -> dict:
    tensors = {"token_embd.weight": (random_blocks("Q8_0", VOCAB, HIDDEN, rng), "Q8_0"),
               "output.weight": (random_blocks("Q6_K", VOCAB, HIDDEN, rng), "Q6_K"),  # untied head, kept float
               "output_norm.weight": ((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "F32")}
    for i, types in enumerate(LAYER_TYPES):
        for (part, (_, shape)), type_name in zip(PARTS.items(), types):
            tensors[f"blk.{i}.{part}.weight"] = (random_blocks(type_name, *shape, rng), type_name)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = ((1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32), "F32")
    return tensors


def _reference_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    top = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
    if base in top:
        return f"{top[base]}.{suffix}"
    _, layer, part = base.split(".")
    norms = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    return f"model.layers.{layer}.{norms.get(part) or PARTS[part][0]}.{suffix}"


def _write_reference(directory: str, gguf_path: str, tensors: dict):
    """The same model as an ordinary float32 checkpoint: gguf.quants.dequantize of every tensor."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    config.architectures = ["LlamaForCausalLM"]
    assert config.tie_word_embeddings is False  # the file has an output.weight
    config.save_pretrained(directory)
    weights = {}
    for name, (data, type_name) in tensors.items():
        values = gguf.quants.dequantize(data, getattr(gguf.GGMLQuantizationType, type_name))
        if ".attn_q." in name or ".attn_k." in name:
            values = hf_order(values, HEADS if ".attn_q." in name else KV_HEADS)
        weights[_reference_name(name)] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    save_file(weights, os.path.join(directory, "model.safetensors"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[str, str]:
    """(GGUF path, reference checkpoint directory)."""
    root = tmp_path_factory.mktemp("tiny_gguf")
    tensors = _tiny_tensors(np.random.default_rng(0))
    path = write_gguf(str(root / "tiny.gguf"), "llama", tensors, METADATA)
    os.makedirs(root / "reference")
    _write_reference(str(root / "reference"), path, tensors)
    return path, str(root / "reference")


def _max_logprob_gap(got: dict, want: dict) -> float:
    pairs = [(g[t].logprob, w[t].logprob) for g, w, t in zip(got["logprobs"], want["logprobs"], got["token_ids"])]
    return max(abs(a - b) for a, b in pairs)


def _greedy(model: str, prompts, max_tokens: int, **options) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    with LLM(model, **ENGINE, **options) as llm:
        layer = llm.runner.model.model.layers[0].self_attn.qkv_proj
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return outputs, layer


def test_tiny_mixed_gguf_generates_exactly_as_its_float32_dequantization(tiny_gguf):
    path, reference = tiny_gguf
    got, qkv = _greedy(path, PROMPTS, 12)
    want, _ = _greedy(reference, PROMPTS, 12)
    # qkv of layer 0 holds Q4_K (4-bit, groups of 32) beside Q6_K (8-bit, groups of 16): one 8-bit layout
    assert qkv.qweight.dtype == torch.int8 and qkv.group_size == 16 and qkv.scales.dtype == torch.float32
    assert not hasattr(qkv, "weight")
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        assert _max_logprob_gap(g, w) <= LOGPROB_TOLERANCE
    assert len({tuple(g["token_ids"]) for g in got}) == 2  # not a degenerate model


def gguf_parses(monkeypatch) -> list[str]:
    """The paths every GGUFReader built from now on parses (transformers' and the engine's alike)."""
    from nanovllm.utils.gguf_model import close_gguf
    close_gguf()  # nothing kept from an earlier test
    paths, real_init = [], gguf.GGUFReader.__init__

    def counting_init(self, path, *args, **kwargs):
        paths.append(str(path))
        real_init(self, path, *args, **kwargs)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting_init)
    return paths


def test_an_engine_parses_its_gguf_once(tiny_gguf, monkeypatch):
    """The config (through transformers), the quantization spec and the weights all read one parse of the file:
    each parse of SmolLM2's metadata costs seconds (test_smollm2_runs_natively_from_its_q4_1_gguf adds the
    tokenizer)."""
    parses = gguf_parses(monkeypatch)
    with LLM(tiny_gguf[0], **ENGINE):
        pass
    assert parses == [tiny_gguf[0]]


def test_a_block_type_the_engine_does_not_read_is_named_before_loading(tmp_path):
    """Q5_0 (not among the supported types): one ValueError naming the tensor and its type, from LLM()."""
    tensors = _tiny_tensors(np.random.default_rng(1))
    weights = np.random.default_rng(2).standard_normal((FFN, HIDDEN)).astype(np.float32)
    tensors["blk.1.ffn_up.weight"] = (gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q5_0), "Q5_0")
    path = write_gguf(str(tmp_path / "q5_0.gguf"), "llama", tensors, METADATA)
    with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' has type Q5_0; supported: .*Q4_K"):
        LLM(path, **ENGINE)


def test_quantization_option_must_match_a_gguf(tiny_gguf):
    with pytest.raises(ValueError, match="quantization='awq' does not match"):
        LLM(tiny_gguf[0], quantization="awq", **ENGINE)


def test_smollm2_runs_natively_from_its_q4_1_gguf(smollm2_dir, monkeypatch):
    from nanovllm.utils.convert import find_gguf
    prompts = ["The capital of France is", "def fibonacci(n):"]
    parses = gguf_parses(monkeypatch)
    got, qkv = _greedy(find_gguf(), prompts, 16)
    assert len(parses) == 1, parses  # config, tokenizer and weights from one parse (6 s of CPU each)
    want, _ = _greedy(smollm2_dir, prompts, 16)
    assert qkv.bits == 4 and qkv.qweight.dtype == torch.int32 and qkv.scales.dtype == torch.float16
    for g, w in zip(got, want):
        assert g["token_ids"] == w["token_ids"]
        assert g["text"] == w["text"]
        assert _max_logprob_gap(g, w) <= LOGPROB_TOLERANCE


def test_the_cli_demo_runs_smollm2s_gguf_natively(smollm2_dir):
    """`nanovllm generate` without --model: the packaged GGUF, its tokenizer and chat template from the file."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "nanovllm.entrypoints.cli", "generate", "What is the capital of France?",
           "--max-tokens", "24", "--enforce-eager", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr
    [line] = [line for line in r.stdout.splitlines() if line.startswith("{")]
    assert "Paris" in json.loads(line)["text"]
