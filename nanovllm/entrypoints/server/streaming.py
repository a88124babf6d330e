"""Responses: the JSON bodies of finished requests, the chunks of streamed ones as Server-Sent Events, and the
watch that aborts a request whose client has gone."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from nanovllm.entrypoints.server.chat_output import chat_delta, chat_message
from nanovllm.entrypoints.server.choices import merged_events, usage
from nanovllm.entrypoints.server.completion_output import CompletionChoices
from nanovllm.entrypoints.server.engine_loop import Delta, EngineError, EngineLoop, RequestStream
from nanovllm.entrypoints.server.openai_logprobs import chat_logprobs
from nanovllm.entrypoints.server.protocol import APIError
from nanovllm.entrypoints.server.reasoning import ChatOutputParser
from nanovllm.entrypoints.server.tool_parsers import NoToolParser


@dataclass
class Reply:
    """What every response object of one request shares; `n`: samples per prompt (choices come prompt-major)."""
    id: str
    model: str
    n: int = 1
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choices: list[dict], object: str = "text_completion", **extra) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices,
                **extra}


async def collect(streams: list[RequestStream], watch: ClientWatch) -> list[Delta]:
    """Wait for each request's last Delta (non-streaming responses)."""
    lasts: list[Delta | None] = [None] * len(streams)
    try:
        async for index, delta in merged_events(streams):
            lasts[index] = delta
    finally:
        watch.close()
    return lasts


def completion_response(reply: Reply, streams: list[RequestStream], lasts: list[Delta],
                        choices: CompletionChoices) -> dict:
    n = reply.n
    body = [choices.choice(i, last, lasts[i - i % n].final_prompt_logprobs) for i, last in enumerate(lasts)]
    return reply.body(body, usage=usage(streams, sum(map(choices.num_completion_tokens, lasts)), n))


def chat_response(reply: Reply, streams: list[RequestStream], lasts: list[Delta], num_top_logprobs: int = 0,
                  parsers: list[ChatOutputParser] | None = None) -> dict:
    """`parsers`: each choice's reader of tool calls and reasoning (chat_output.py); None: all text is content."""
    parsers = parsers or [ChatOutputParser(NoToolParser()) for _ in lasts]
    choices = [{"index": i, "message": chat_message(parsers[i], last.final_text),
                "logprobs": None if last.final_logprobs is None else chat_logprobs(last.final_logprobs,
                                                                                    num_top_logprobs),
                "finish_reason": parsers[i].finish_reason(last.finish_reason)} for i, last in enumerate(lasts)]
    return reply.body(choices, object="chat.completion",
                      usage=usage(streams, sum(last.num_completion_tokens for last in lasts), reply.n))


async def completion_chunks(reply: Reply, streams: list[RequestStream], include_usage: bool,
                            choices: CompletionChoices) -> AsyncIterator[dict]:
    n = reply.n
    num_tokens = [0] * len(streams)
    text_offsets = [0] * len(streams)  # per choice: where its next token's text starts (legacy logprobs)
    echoed = [False] * len(streams)  # per choice: its prompt has been sent (echo)
    prompt_entries: dict[int, list] = {}  # per prompt: its logprobs, from its first sample's first delta
    held: dict[int, list[Delta]] = {}  # per choice: deltas that came before their prompt's logprobs (echo)
    async for i, delta in merged_events(streams):
        if delta.finish_reason == "abort":
            return
        if delta.stream.prompt_logprobs is not None:
            prompt_entries[i // n] = delta.stream.prompt_logprobs
        held.setdefault(i, []).append(delta)
        if choices.echo_needs_prompt_logprobs and i // n not in prompt_entries:
            continue  # a sibling sample ahead of its prompt's first sample
        for j in [j for j in range(i - i % n, i - i % n + n) if j in held]:
            for ready in held.pop(j):
                num_tokens[j] = choices.num_completion_tokens(ready)
                logprobs = choices.logprobs(j, prompt_entries.get(j // n), ready.logprobs, echoed[j], text_offsets[j])
                if logprobs is not None:
                    text_offsets[j] += sum(map(len, logprobs["tokens"]))
                text = choices.text(j, ready.text, echoed[j])
                echoed[j] = True
                yield reply.body([{"index": j, "text": text, "logprobs": logprobs,
                                   "finish_reason": ready.finish_reason}])
    if include_usage:
        yield reply.body([], usage=usage(streams, sum(num_tokens), n))


async def chat_chunks(reply: Reply, streams: list[RequestStream], include_usage: bool,
                      num_top_logprobs: int = 0, parsers: list[ChatOutputParser] | None = None) -> AsyncIterator[dict]:
    chunk = "chat.completion.chunk"
    parsers = parsers or [ChatOutputParser(NoToolParser()) for _ in streams]
    for i in range(len(streams)):  # each choice opens with its role, as vLLM sends it
        yield reply.body([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}], object=chunk)
    num_tokens = [0] * len(streams)
    async for i, delta in merged_events(streams):
        if delta.finish_reason == "abort":
            return
        num_tokens[i] = delta.num_completion_tokens
        logprobs = None if delta.logprobs is None else chat_logprobs(delta.logprobs, num_top_logprobs)
        yield reply.body([{"index": i, "delta": chat_delta(parsers[i], delta.text, delta.finish_reason is not None),
                           "logprobs": logprobs, "finish_reason": parsers[i].finish_reason(delta.finish_reason)}],
                         object=chunk)
    if include_usage:
        yield reply.body([], object=chunk, usage=usage(streams, sum(num_tokens), reply.n))


def sse_response(chunks: AsyncIterator[dict], watch: ClientWatch) -> StreamingResponse:
    """Server-Sent Events: one `data: {json}` per chunk, then `data: [DONE]`."""
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except EngineError as e:  # the status line is already sent; report it in the stream
            yield f"data: {json.dumps(APIError(500, str(e), type='server_error').body)}\n\n"
        finally:
            watch.close()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class ClientWatch:
    """Aborts a request's engine requests (one per choice) when its client disconnects, streaming or not. A task
    reads the ASGI receive channel, which says `http.disconnect` once the client is gone (the body has been read
    already). Started by the handler, so it also covers a streaming response whose body never ran; `close()` when
    the response is done, or left early."""

    def __init__(self, engine: EngineLoop, streams: list[RequestStream], request: Request):
        self.engine = engine
        self.streams = streams
        self.task = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request):
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for stream in self.streams:
            self.engine.abort(stream)

    def close(self):
        self.task.cancel()
        for stream in self.streams:
            if not stream.is_finished:
                self.engine.abort(stream)
