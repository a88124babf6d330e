from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """The public entry point: `LLM(model_dir, **options).generate(prompts, sampling_params)`.

    Use `with LLM(...) as llm:` or call `llm.close()` to release the KV cache, the host pool and worker processes.
    """

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params gets (vLLM's name): the model's generation_config.json defaults
        for temperature, top_p, top_k and min_p (see Config.generation_config), SamplingParams' own for the rest."""
        return SamplingParams(**self.default_sampling_options)

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's name); None when the model directory has no tokenizer files."""
        return self.tokenizer
