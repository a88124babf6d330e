"""What generate() and add_request() take in, checked against this engine before anything is queued (no torch).

A prompt becomes token ids (tokenized, cut by truncate_prompt_tokens, inside the vocabulary, within max_model_len
and the KV cache); the options that depend on the engine are checked (a tokenizer for text options, max_logprobs,
logit_bias's token ids). Only the engine's fixed parts are read, so a bad request leaves the engine untouched, and
any thread may check one (the server checks in its handlers' worker threads, off the engine loop's thread).

Each request is checked and tokenized once, here: what comes out is a CheckedRequest, which the engine queues
without looking at it again.
"""
from dataclasses import dataclass, replace

from nanovllm.config import Config
from nanovllm.engine.logit_rules import bad_words_token_ids
from nanovllm.engine.parallel_sampling import sample_params
from nanovllm.inputs import as_prompt_list, check_prompt, checked_params
from nanovllm.sampling_params import SamplingParams


@dataclass
class CheckedRequest:
    """One prompt's request as RequestIntake accepted it. NOTE: built only by RequestIntake (or `samples`), so
    whoever holds one may queue it unchecked (LLMEngine.add_checked_request)."""
    token_ids: list[int]  # the prompt, tokenized and cut by truncate_prompt_tokens
    sampling_params: SamplingParams  # the request's own checked copy; max_tokens=None became the room left
    bad_words_token_ids: list[list[int]]  # bad_words, tokenized (logit_rules.py)
    prompt_text: str | None = None  # RequestOutput.prompt: the prompt's text, None when it came as token ids

    def samples(self) -> list["CheckedRequest"]:
        """One request per sequence to generate (n / best_of: parallel_sampling.sample_params), sharing the prompt."""
        params = sample_params(self.sampling_params)
        if len(params) == 1:
            return [self]
        return [replace(self, sampling_params=child) for child in params]


class RequestIntake:
    def __init__(self, config: Config, tokenizer, num_gpu_blocks: int, check_constraint=None):
        self.config = config
        self.tokenizer = tokenizer
        self.num_gpu_blocks = num_gpu_blocks
        # StructuredOutputs.check: compiles a request's grammar (cached), a ValueError naming the field; the server
        # calls `checked` in its handlers' threads, so the compiling happens off the loop thread
        self.check_constraint = check_constraint

    def room_left(self, num_prompt_tokens: int) -> int:
        """max_tokens=None: up to max_model_len, and no more than the whole GPU KV cache holds."""
        max_len = min(self.config.max_model_len, self.num_gpu_blocks * self.config.kvcache_block_size)
        return max(1, max_len - num_prompt_tokens)

    def checked(self, prompt, sampling_params: SamplingParams) -> CheckedRequest:
        """One request; `sampling_params` is already a checked copy (inputs.checked_params), which the request
        keeps (its max_tokens=None becomes the room left). Raises ValueError naming the problem."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        text = check_prompt(prompt)
        token_ids = self._prompt_token_ids(text, sampling_params)
        if sampling_params.max_tokens is None:
            sampling_params.max_tokens = self.room_left(len(token_ids))
        bad_words = bad_words_token_ids(self.tokenizer, sampling_params.bad_words) if sampling_params.bad_words else []
        if self.check_constraint is not None:
            self.check_constraint(sampling_params.structured_outputs)
        return CheckedRequest(token_ids, sampling_params, bad_words, text if isinstance(text, str) else None)

    def _prompt_token_ids(self, token_ids: str | list[int], sampling_params: SamplingParams) -> list[int]:
        """A checked prompt (check_prompt's text or token ids) as token ids that fit this engine."""
        if isinstance(token_ids, str):
            if self.tokenizer is None:
                raise ValueError(f"model={self.config.model!r} has no tokenizer files; pass prompts as token ids")
            token_ids = self.tokenizer.encode(token_ids)
        if not token_ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        max_len = self.config.max_model_len
        if sampling_params.truncate_prompt_tokens is not None:  # -1: the last max_model_len tokens
            keep = sampling_params.truncate_prompt_tokens
            token_ids = token_ids[-(max_len if keep == -1 else keep):]
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        self.check_options(sampling_params)
        if len(token_ids) > max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_len}; "
                             f"shorten it or raise max_model_len")
        # the last token is sampled and never computed: its KV needs no slot
        max_tokens = sampling_params.max_tokens or self.room_left(len(token_ids))
        num_tokens = max(min(len(token_ids) + max_tokens, max_len) - 1, len(token_ids))
        num_blocks = (num_tokens + self.config.kvcache_block_size - 1) // self.config.kvcache_block_size
        if num_blocks > self.num_gpu_blocks:
            raise ValueError(f"request needs {num_blocks} KV blocks ({num_tokens} tokens) but the cache has "
                             f"{self.num_gpu_blocks}; lower max_tokens or raise num_kvcache_blocks / the KV budget")
        return token_ids

    def check_options(self, sampling_params: SamplingParams):
        """The options checked against this engine: a tokenizer for text options, max_logprobs, the vocabulary."""
        vocab = self.config.hf_config.vocab_size
        for name in ("stop", "bad_words"):
            if getattr(sampling_params, name) and self.tokenizer is None:
                raise ValueError(f"{name}={getattr(sampling_params, name)!r} needs a tokenizer, and model="
                                 f"{self.config.model!r} has none; pass token ids (stop_token_ids, logit_bias) instead")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(sampling_params, name)
            if value is not None and value > self.config.max_logprobs:
                raise ValueError(f"{name}={value} is more than max_logprobs={self.config.max_logprobs}; ask for "
                                 f"fewer or raise LLM(max_logprobs=...)")
            if value is not None and value > vocab:
                raise ValueError(f"{name}={value} is more than the vocabulary's {vocab} tokens; ask for fewer")
        bad = [t for t in sampling_params.logit_bias or () if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab})")

    def checked_batch(self, prompts, sampling_params, default_options: dict,
                      streaming: bool = False) -> list[CheckedRequest]:
        """generate()'s arguments as checked requests, all of them checked before any is queued: one prompt or a
        list of them, and one SamplingParams for all, one each, or None (the engine's defaults). streaming refuses
        best_of > n: which samples are returned is known only at the end (vLLM refuses it with streaming too)."""
        prompts = as_prompt_list(prompts)  # one prompt (a string or token ids) or a list of them
        if sampling_params is None:
            sampling_params = SamplingParams(**default_options)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts; pass one or one each")
        # checked again here, not only when built: a SamplingParams may have been changed since (they are mutable,
        # as in vLLM); each request keeps its own checked copy, so a later change cannot reach it either
        pairs = [(prompt, checked_params(sp)) for prompt, sp in zip(prompts, sampling_params)]
        for _, sp in pairs:
            sample_params(sp)  # a seed + i out of range fails here, before anything is queued
            if streaming and sp.num_samples > sp.n:
                raise ValueError(f"best_of={sp.best_of} > n={sp.n} cannot stream: the best samples are known only at "
                                 f"the end; use generate(), or best_of=None")
        return [self.checked(prompt, sp) for prompt, sp in pairs]
