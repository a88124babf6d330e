"""A request's prompt and options turned into what the engine loop adds: a CheckedRequest (token ids, a
SamplingParams, the bad words' token ids).

This runs in a worker thread of the request's handler, never on the engine loop's thread: tokenizing a long prompt
or rendering a chat template takes time (seconds for megabytes), and on the loop thread it would stall every other
stream. It only reads the engine's immutable parts (its config, the tokenizer, the size of the GPU cache), the
engine's own checks included (RequestIntake), so the loop queues the request without checking it again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from nanovllm.engine.request_intake import CheckedRequest
from nanovllm.engine.tokenizer import chat_token_ids
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.llm import LLM


def prepare(llm: LLM, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
            sampling: dict | None = None, chat_template_kwargs: dict | None = None,
            max_tokens_is_a_cap: bool = False) -> CheckedRequest:
    """Tokenize (or render the chat template for) one request, build its SamplingParams and check it against the
    engine; exactly one of `prompt` / `messages` is set (`chat_template_kwargs`: the template's extra variables,
    `tools` among them).
    `max_tokens_is_a_cap`: a max_tokens past max_model_len is lowered to what fits instead of refused (Anthropic's
    clients send their model's limit, e.g. 32,000, whatever the prompt). Raises ValueError naming the problem."""
    token_ids = prompt_token_ids(llm, prompt, messages, chat_template_kwargs)
    max_len = llm.config.max_model_len
    if len(token_ids) > max_len:  # checked here so the loop thread never scans an overlong list
        raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_len}; shorten it")
    options = dict(sampling or {})
    if options.get("max_tokens") is None:
        options["max_tokens"] = room_left(llm, token_ids)
    elif max_tokens_is_a_cap:
        options["max_tokens"] = min(options["max_tokens"], room_left(llm, token_ids))
    elif len(token_ids) + options["max_tokens"] > max_len:  # OpenAI and vLLM refuse it rather than cut it short
        raise ValueError(f"the prompt's {len(token_ids)} tokens and max_tokens={options['max_tokens']} make "
                         f"{len(token_ids) + options['max_tokens']}, more than max_model_len={max_len}; lower "
                         f"max_tokens or shorten the prompt")
    return llm.intake.checked(token_ids, SamplingParams(**{**llm.default_sampling_options, **options}))


def prompt_token_ids(llm: LLM, prompt: str | list[int] | None, messages: list[dict] | None,
                     chat_template_kwargs: dict | None = None) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise ValueError(f"model {llm.config.model!r} has no tokenizer files; send the prompt as token ids "
                         f"to /v1/completions")
    if messages is None:
        return tokenizer.encode(prompt)
    return chat_token_ids(tokenizer, messages, llm.config.model, chat_template_kwargs=chat_template_kwargs)


def room_left(llm: LLM, token_ids: list[int]) -> int:
    """The default max_tokens: up to max_model_len, and no more than the whole GPU KV cache holds."""
    config = llm.config
    if len(token_ids) >= config.max_model_len:
        raise ValueError(f"prompt has {len(token_ids)} tokens, max_model_len={config.max_model_len} leaves no "
                         f"room for a completion; shorten it")
    return llm.intake.room_left(len(token_ids))  # at least 1: past the cache, the intake's check names the limit
