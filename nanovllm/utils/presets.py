"""Real model shapes as config.json-only directories, for load_format="dummy" benchmarks."""
import json
import os
import tempfile

PRESETS = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # the most prefill work per KV byte of these: where a fast disk beats an H100's prefill (the disk tier's rule)
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}
# the quantized checkpoints' shapes: Qwen's own Qwen3-8B-AWQ (4 bits, groups of 128) and Qwen3-*-FP8 (blocks of
# 128 x 128); embeddings, norms and lm_head stay in bf16 as in those checkpoints (quantize_lm_head="int8" rounds
# the vocabulary weights too)
AWQ_W4_G128 = dict(quant_method="awq", bits=4, group_size=128, zero_point=True, version="gemm")
FP8_BLOCK_128 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
PRESETS["qwen3-8b-awq"] = dict(PRESETS["qwen3-8b"], quantization_config=AWQ_W4_G128)
PRESETS["qwen3-4b-fp8"] = dict(PRESETS["qwen3-4b"], quantization_config=FP8_BLOCK_128)
PRESETS["qwen3-8b-fp8"] = dict(PRESETS["qwen3-8b"], quantization_config=FP8_BLOCK_128)
PRESETS["qwen3-1.7b-fp8"] = dict(PRESETS["qwen3-1.7b"], quantization_config=FP8_BLOCK_128)
QWEN3_COMMON = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
                    max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu",
                    attention_bias=False, torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)


def preset_dir(name: str) -> str:
    """A directory holding only config.json for the named shape (pass load_format="dummy")."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    path = os.path.join(tempfile.gettempdir(), "nanovllm-presets", name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**QWEN3_COMMON, **PRESETS[name]}, f, indent=1)
    return path
