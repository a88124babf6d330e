"""Quantized weights in memory: a dummy-loaded quantized preset holds exactly its layout's bytes (what the memory
plan measures as weights: torch's allocated memory after loading, engine/memory_profile.py), and its random weights
have the spread of the unquantized dummy init, so the logits are finite and of the usual size."""
import json
import math

import pytest

from conftest import close_llm, greedy
from nanovllm import LLM
from nanovllm.utils.presets import PRESETS, QWEN3_COMMON

VOCAB = 1024


def linear_shapes(p: dict) -> list[tuple[int, int]]:
    """(N, K) of one layer's linear layers, merged as the engine holds them."""
    q, kv = p["num_attention_heads"] * p["head_dim"], p["num_key_value_heads"] * p["head_dim"]
    h, i = p["hidden_size"], p["intermediate_size"]
    return [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]


def layout_bytes(quantization_config: dict, n: int, k: int) -> int:
    if quantization_config["quant_method"] == "awq":  # 4-bit values, an fp16 scale and an fp32 min per group
        g = quantization_config["group_size"]
        return n * k // 2 + n * (k // g) * (2 + 4)
    bn, bk = quantization_config["weight_block_size"]  # e4m3 values, an fp32 scale per block
    return n * k + 4 * math.ceil(n / bn) * math.ceil(k / bk)


@pytest.mark.parametrize("preset,head", [("qwen3-8b-awq", None), ("qwen3-4b-fp8", None), ("qwen3-8b-awq", "int8"),
                                         ("qwen3-4b-fp8", "int8")])
def test_dummy_quantized_preset_holds_its_layout_bytes(tmp_path, preset, head):
    """The preset's quantization_config on a small model of its family (one layer, 1/8 of the width), to stay
    fast on the CPU."""
    p = {**QWEN3_COMMON, **PRESETS[preset], "num_hidden_layers": 1, "vocab_size": VOCAB, "hidden_size": 512,
         "intermediate_size": 1536, "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(p))
    llm = LLM(str(tmp_path), device="cpu", load_format="dummy", max_model_len=64, kvcache_block_size=16,
              num_kvcache_blocks=8, enforce_eager=True, quantize_lm_head=head)
    try:
        out = llm.generate([[5, 6, 7, 8, 9]], greedy(2, prompt_logprobs=1), use_tqdm=False)[0]
        model = llm.runner.model
        quantized = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
        assert len(quantized) == 4 and all(m.quant_method.is_quantized for m in quantized)
        held = sum(p.numel() * p.element_size() for m in quantized for p in m.parameters())
        qc = p["quantization_config"]
        assert held == sum(layout_bytes(qc, n, k) for n, k in linear_shapes(p))
        # the rest (embedding, norms; the untied 8B's lm_head) in the model's dtype (float32 here), or the
        # vocabulary weights as int8 with a float32 scale per row
        rest = sum(p.numel() * p.element_size() for p in model.parameters()) - held
        h, num_vocab_weights = p["hidden_size"], 1 if p["tie_word_embeddings"] else 2
        vocab_bytes = VOCAB * (h + 4) if head == "int8" else 4 * VOCAB * h
        assert rest == num_vocab_weights * vocab_bytes + 4 * (3 * h + 2 * p["head_dim"])
        for m in quantized:  # the unquantized dummy init's spread: normal(0, 0.02)
            assert 0.015 < m.quant_method.dequantize(m).std().item() < 0.025, m
        logprobs = [v.logprob for entry in out["prompt_logprobs"][1:] for v in entry.values()]
        assert all(-2 * math.log(VOCAB) < lp <= 0 for lp in logprobs), logprobs
    finally:
        close_llm(llm)
