from nanovllm.engine.caller_lock import CallerLock, closing, one_caller, one_caller_stream
from nanovllm.engine.llm_engine import LLMEngine
from nanovllm.engine.tokenizer import chat_text, read_chat_template
from nanovllm.sampling_params import SamplingParams


class LLM(LLMEngine):
    """The public entry point: `LLM(model_dir, **options).generate(prompts, sampling_params)`.

    Use `with LLM(...) as llm:` or call `llm.close()` to release the KV cache, the host pool and worker processes.
    One caller at a time: a second thread's call waits for the first to return; after close() every call raises
    RuntimeError (nanovllm/engine/caller_lock.py).
    """

    def __init__(self, model: str, **kwargs):
        self.caller_lock = CallerLock()  # before the engine starts: a failed start calls close()
        super().__init__(model, **kwargs)

    add_request = one_caller(LLMEngine.add_request)
    add_checked_request = one_caller(LLMEngine.add_checked_request)
    abort_request = one_caller(LLMEngine.abort_request)
    reset_prefix_cache = one_caller(LLMEngine.reset_prefix_cache)
    step = one_caller(LLMEngine.step)
    generate = one_caller(LLMEngine.generate)
    generate_stream = one_caller_stream(LLMEngine.generate_stream)
    close = closing(LLMEngine.close)

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without sampling params gets (vLLM's name): the model's generation_config.json defaults
        for temperature, top_p, top_k and min_p (see Config.generation_config), SamplingParams' own for the rest."""
        return SamplingParams(**self.default_sampling_options)

    @one_caller
    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None) -> list[dict]:
        """vLLM's LLM.chat: one conversation (a list of {"role", "content"} messages) or a list of them, each rendered
        by the tokenizer's chat template (`chat_template_kwargs` go to it, e.g. {"enable_thinking": False} for
        Qwen3), then generated as `generate` does. `chat_template`: another template, its text or the path of its
        file. ValueError for a model without a chat template."""
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"messages={messages!r} must be a non-empty list of messages, or a list of those")
        if chat_template is not None:
            chat_template = read_chat_template(chat_template)
        conversations = [messages] if isinstance(messages[0], dict) else messages
        texts = [chat_text(self.tokenizer, conversation, self.config.model, add_generation_prompt,
                           chat_template_kwargs, chat_template) for conversation in conversations]
        # token ids, not text: the template wrote its special tokens, which encoding the text would add again
        outputs = self.generate([self.tokenizer.encode(text, add_special_tokens=False) for text in texts],
                                sampling_params, use_tqdm=use_tqdm)
        for output, text in zip(outputs, texts):
            output.prompt = text  # vLLM's: the rendered conversation
        return outputs

    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (vLLM's name); None when the model directory has no tokenizer files."""
        return self.tokenizer
