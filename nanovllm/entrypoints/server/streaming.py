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

from nanovllm.entrypoints.server.engine_loop import Delta, EngineError, EngineLoop, RequestStream
from nanovllm.entrypoints.server.openai_logprobs import chat_logprobs, completion_logprobs
from nanovllm.entrypoints.server.protocol import APIError


def usage(stream: RequestStream, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": stream.num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": stream.num_prompt_tokens + num_completion_tokens}


@dataclass
class Reply:
    """What every response object of one request shares."""
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choice: dict, object: str = "text_completion", **extra) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [choice] if choice else [], **extra}


async def collect(stream: RequestStream, watch: ClientWatch) -> Delta:
    """Wait for a request's last Delta (non-streaming responses)."""
    last = None
    try:
        async for last in stream.events():  # noqa: B007 (the loop keeps the last one)
            pass
    finally:
        watch.close()
    return last


def completion_response(reply: Reply, stream: RequestStream, last: Delta) -> dict:
    logprobs = None if last.final_logprobs is None else completion_logprobs(last.final_logprobs)
    choice = {"index": 0, "text": last.final_text, "logprobs": logprobs, "finish_reason": last.finish_reason}
    return reply.body(choice, usage=usage(stream, last.num_completion_tokens))


def chat_response(reply: Reply, stream: RequestStream, last: Delta, num_top_logprobs: int = 0) -> dict:
    logprobs = None if last.final_logprobs is None else chat_logprobs(last.final_logprobs, num_top_logprobs)
    choice = {"index": 0, "message": {"role": "assistant", "content": last.final_text}, "logprobs": logprobs,
              "finish_reason": last.finish_reason}
    return reply.body(choice, object="chat.completion", usage=usage(stream, last.num_completion_tokens))


async def completion_chunks(reply: Reply, stream: RequestStream, include_usage: bool) -> AsyncIterator[dict]:
    num_tokens = text_offset = 0  # text_offset: where the next token's text starts (legacy logprobs)
    async for delta in stream.events():
        if delta.finish_reason == "abort":
            return
        num_tokens = delta.num_completion_tokens
        logprobs = None
        if delta.logprobs is not None:
            logprobs = completion_logprobs(delta.logprobs, text_offset)
            text_offset += sum(map(len, logprobs["tokens"]))
        yield reply.body({"index": 0, "text": delta.text, "logprobs": logprobs,
                                "finish_reason": delta.finish_reason})
    if include_usage:
        yield reply.body({}, usage=usage(stream, num_tokens))


async def chat_chunks(reply: Reply, stream: RequestStream, include_usage: bool,
                      num_top_logprobs: int = 0) -> AsyncIterator[dict]:
    chunk = "chat.completion.chunk"
    yield reply.body({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, object=chunk)
    num_tokens = 0
    async for delta in stream.events():
        if delta.finish_reason == "abort":
            return
        num_tokens = delta.num_completion_tokens
        logprobs = None if delta.logprobs is None else chat_logprobs(delta.logprobs, num_top_logprobs)
        yield reply.body({"index": 0, "delta": {"content": delta.text} if delta.text else {},
                                "logprobs": logprobs, "finish_reason": delta.finish_reason}, object=chunk)
    if include_usage:
        yield reply.body({}, object=chunk, usage=usage(stream, num_tokens))


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
    """Aborts a request when its client disconnects, streaming or not. A task reads the ASGI receive channel, which
    says `http.disconnect` once the client is gone (the body has been read already). Started by the handler, so it
    also covers a streaming response whose body never ran; `close()` when the response is done, or left early."""

    def __init__(self, engine: EngineLoop, stream: RequestStream, request: Request):
        self.engine = engine
        self.stream = stream
        self.task = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request):
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine.abort(self.stream)

    def close(self):
        self.task.cancel()
        if not self.stream.is_finished:
            self.engine.abort(self.stream)
