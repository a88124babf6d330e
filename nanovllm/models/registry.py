"""Which model class serves which `architectures` entry of config.json (torch-free, so config can check it early)."""

# architecture name -> model family; every family is built by nanovllm.models.decoder.DecoderForCausalLM
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}
