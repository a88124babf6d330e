"""vLLM's LLM() options under this engine's names: its aliases mapped, its options without effect here checked and
dropped (plain Python, before Config sees the options)."""

# vLLM's LLM() options this engine has no use for, each with the values that ask for what it always does (and why):
# accepted with those values, so a vLLM script runs; any other value is a ValueError, never silently dropped
VLLM_OPTIONS_WITHOUT_EFFECT = {
    "enable_chunked_prefill": ((True, None), "prefills are always chunked, max_num_batched_tokens at a time"),
    "tokenizer_mode": (("auto", "hf"), "the model's Hugging Face tokenizer is always used"),
    "task": (("auto", "generate"), "this engine generates text only"),
    "runner": (("auto", "generate"), "this engine generates text only"),
    "revision": ((None,), "models load from a local directory or GGUF file, never from a hub"),
    "tokenizer_revision": ((None,), "models load from a local directory or GGUF file, never from a hub"),
    "download_dir": ((None,), "models load from a local directory or GGUF file, never from a hub"),
    "pipeline_parallel_size": ((1,), "only tensor parallelism is implemented (tensor_parallel_size)"),
    "enable_lora": ((False, None), "LoRA adapters are not implemented"),
    "speculative_config": ((None,), "speculative decoding is not implemented"),
    "cpu_offload_gb": ((0, None), "weights stay on the GPU; KV moves to host memory instead (swap_space)"),
}
VLLM_ALIASES = {"block_size": "kvcache_block_size"}  # vLLM's name -> this engine's


def from_vllm_options(options: dict) -> dict:
    """LLM()'s keyword options with vLLM's names mapped to this engine's (VLLM_ALIASES) and the options without
    effect (VLLM_OPTIONS_WITHOUT_EFFECT) checked and dropped. ValueError naming an option and its value otherwise."""
    options = dict(options)
    for vllm_name, name in VLLM_ALIASES.items():
        if vllm_name in options:
            if name in options:
                raise ValueError(f"{vllm_name}={options[vllm_name]!r} is vLLM's name for {name}, which is set too; "
                                 f"pass one of them")
            options[name] = options.pop(vllm_name)
    for name, (no_op_values, why) in VLLM_OPTIONS_WITHOUT_EFFECT.items():
        if name in options:
            value = options.pop(name)
            if not any(value is v or (type(value) is type(v) and value == v) for v in no_op_values):
                raise ValueError(f"{name}={value!r} is one of vLLM's options this engine does not implement: {why}; "
                                 f"leave it out (or {no_op_values[0]!r})")
    return options
