"""The routes that answer without generating: /version, /tokenize and /detokenize, with vLLM's request and response
bodies.

/tokenize takes a completion's `prompt` or a chat's `messages` (rendered by the chat template as
/v1/chat/completions renders them) and answers {"count", "max_model_len", "tokens", "token_strs"}; /detokenize
takes {"tokens"} and answers {"prompt"}. Both run in the request preparers' threads, never on the event loop: a long
text takes a while to tokenize.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from fastapi import Body, FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError

from nanovllm.engine.tokenizer import chat_token_ids
from nanovllm.entrypoints.server.protocol import APIError, ChatMessage, find_unencodable
from nanovllm.version import package_version

if TYPE_CHECKING:
    from nanovllm.llm import LLM


class _ModelRequest(BaseModel):
    model_config = ConfigDict(strict=True)  # as protocol.py's bodies: 8.0 is not a token id
    model: str | None = None  # None: the served model

    def check(self, served_model_name: str):
        if self.model is not None and self.model != served_model_name:
            raise APIError(404, f"model {self.model!r} is not served here; this server serves {served_model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")


class TokenizeCompletionRequest(_ModelRequest):
    prompt: str
    add_special_tokens: bool = True  # vLLM's default for a prompt: the tokenizer's BOS, as /v1/completions adds it
    return_token_strs: bool = False


class TokenizeChatRequest(_ModelRequest):
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes its own special tokens
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self, served_model_name: str):
        super().check(served_model_name)
        if self.continue_final_message:
            raise APIError(400, "continue_final_message=true is not supported by this server",
                           param="continue_final_message")
        if self.add_special_tokens:
            raise APIError(400, "add_special_tokens=true is not supported with messages (the chat template writes "
                                "the special tokens)", param="add_special_tokens")
        if not self.messages:
            raise APIError(400, "messages is empty: a chat needs at least one message", param="messages")


class DetokenizeRequest(_ModelRequest):
    tokens: list[int]


def tokenize_request(body: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's two /tokenize bodies, told apart by `messages`."""
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object with `prompt` or `messages`")
    where = find_unencodable(body)
    if where is not None:
        raise APIError(400, f"{where} has a lone surrogate; send text that is valid UTF-8", param=where)
    model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def tokenize(llm: LLM, request: TokenizeCompletionRequest | TokenizeChatRequest) -> dict:
    tokenizer = _tokenizer(llm)
    if isinstance(request, TokenizeChatRequest):
        messages = [m.as_template_message() for m in request.messages]
        token_ids = chat_token_ids(tokenizer, messages, llm.config.model, request.add_generation_prompt,
                                   request.chat_template_kwargs)
    else:
        token_ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    token_strs = tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
    return {"count": len(token_ids), "max_model_len": llm.config.max_model_len, "tokens": token_ids,
            "token_strs": token_strs}


def detokenize(llm: LLM, request: DetokenizeRequest) -> dict:
    tokenizer = _tokenizer(llm)
    vocab_size = llm.config.hf_config.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return {"prompt": tokenizer.decode(request.tokens)}


def _tokenizer(llm: LLM):
    if llm.tokenizer is None:
        raise ValueError(f"model {llm.config.model!r} has no tokenizer files, so nothing to tokenize with")
    return llm.tokenizer


def add_info_routes(app: FastAPI, llm: LLM, served_model_name: str, preparers: ThreadPoolExecutor):
    async def off_the_loop(fn, *args) -> dict:
        try:
            return await asyncio.get_running_loop().run_in_executor(preparers, fn, *args)
        except ValueError as e:  # the message names the problem
            raise APIError(400, str(e)) from None

    @app.get("/version")
    async def version():
        return {"version": package_version()}

    @app.post("/tokenize")
    async def tokenize_route(body: Any = Body(...)):  # noqa: B008 (FastAPI reads the default)
        request = tokenize_request(body)
        request.check(served_model_name)
        return await off_the_loop(tokenize, llm, request)

    @app.post("/detokenize")
    async def detokenize_route(request: DetokenizeRequest):
        request.check(served_model_name)
        return await off_the_loop(detokenize, llm, request)
