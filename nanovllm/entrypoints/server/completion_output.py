"""What a /v1/completions choice holds besides its generated text: vLLM's `echo` (the prompt before the completion,
its tokens first in the legacy logprobs) and `prompt_logprobs`. Choice i is prompt i // n's (choices.py); only a
prompt's first sample computes the prompt's logprobs (parallel_sampling.py), so its siblings take them from it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from nanovllm.entrypoints.server.engine_loop import Delta, RequestStream
from nanovllm.entrypoints.server.openai_logprobs import completion_logprobs, prompt_logprobs

if TYPE_CHECKING:
    from nanovllm.entrypoints.server.protocol import CompletionRequest


@dataclass
class CompletionChoices:
    n: int  # samples per prompt
    echo: bool
    generates: bool  # False: echo with max_tokens=0, the prompt alone (its one generated token dropped)
    with_logprobs: bool  # the legacy `logprobs` was asked for
    with_prompt_logprobs: bool  # vLLM's `prompt_logprobs` was asked for
    prompt_texts: list[str]  # per prompt: what echo writes (the prompt as sent, token ids decoded)
    first_token_texts: list[str]  # per prompt: its first token's text (echoed with a null logprob)

    @classmethod
    def of(cls, body: CompletionRequest, streams: list[RequestStream],
           decode: Callable[[list[int]], str]) -> CompletionChoices:
        """`decode`: token ids to text, run only with echo (a long prompt of token ids takes a while: call this off
        the event loop then)."""
        prompts = body.prompts() if body.echo else []
        first_ids = [streams[p * body.n].prompt_token_ids[:1] for p in range(len(prompts))]
        return cls(body.n, body.echo, body.generates, body.logprobs is not None, body.prompt_logprobs is not None,
                   [prompt if isinstance(prompt, str) else decode(prompt) for prompt in prompts],
                   [decode(ids) for ids in first_ids])

    @property
    def echo_needs_prompt_logprobs(self) -> bool:
        """A choice's first streamed chunk carries its prompt's logprobs: it waits for them."""
        return self.echo and self.with_logprobs

    def num_completion_tokens(self, delta: Delta) -> int:
        return delta.num_completion_tokens if self.generates else 0

    def choice(self, index: int, last: Delta, prompt_entries: list | None) -> dict:
        """A whole choice (non-streaming); `prompt_entries`: its prompt's logprobs, from the prompt's first sample."""
        body = {"index": index, "text": self.text(index, last.final_text, echoed=False),
                "logprobs": self.logprobs(index, prompt_entries, last.final_logprobs, echoed=False),
                "finish_reason": last.finish_reason}
        if self.with_prompt_logprobs:
            body["prompt_logprobs"] = prompt_logprobs(prompt_entries or [])
        return body

    def text(self, index: int, generated: str, echoed: bool) -> str:
        """The text of a choice's chunk; `echoed`: the choice's prompt has been sent already."""
        prompt = self.prompt_texts[index // self.n] if self.echo and not echoed else ""
        return prompt + (generated if self.generates else "")

    def logprobs(self, index: int, prompt_entries: list | None, entries: list | None, echoed: bool,
                 text_offset: int = 0) -> dict | None:
        """The legacy logprobs of a choice's chunk (None unless asked for), the prompt's first when echoed now."""
        if not self.with_logprobs:
            return None
        echoed_entries = (prompt_entries or []) if self.echo and not echoed else []
        generated_entries = (entries or []) if self.generates else []
        unscored_text = self.first_token_texts[index // self.n] if echoed_entries else ""
        return completion_logprobs(echoed_entries + generated_entries, text_offset, unscored_text)
