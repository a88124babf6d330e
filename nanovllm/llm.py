from nanovllm.engine.llm_engine import LLMEngine


class LLM(LLMEngine):
    """The public entry point: `LLM(model_dir, **options).generate(prompts, sampling_params)`.

    Use `with LLM(...) as llm:` or call `llm.close()` to release the KV cache, the host pool and worker processes.
    """

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's name); None when the model directory has no tokenizer files."""
        return self.tokenizer
