"""/v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the same engine loop, chat template,
tool parsers and reasoning parser as /v1/chat/completions (the request is translated by anthropic_protocol.py and
planned by tools.py; only the answer's shape differs).

A streamed answer is Anthropic's event sequence: `message_start`, a `ping`, then per content block
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, `input_json_delta`) and `content_block_stop`,
then `message_delta` (stop_reason, output tokens) and `message_stop`. Blocks come in the order the model writes them:
its reasoning (a `thinking` block), its text, its calls (a `tool_use` block each, the input streamed as JSON text).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated, AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.responses import StreamingResponse

from nanovllm.entrypoints.server import streaming
from nanovllm.entrypoints.server.anthropic_protocol import MessagesRequest, tool_input
from nanovllm.entrypoints.server.body import json_body
from nanovllm.entrypoints.server.chat_output import merged_calls
from nanovllm.entrypoints.server.choices import submit_choices
from nanovllm.entrypoints.server.engine_loop import Delta, EngineError, EngineLoop, RequestStream
from nanovllm.entrypoints.server.prepare import prompt_token_ids
from nanovllm.entrypoints.server.protocol import APIError
from nanovllm.entrypoints.server.reasoning import ChatOutputParser
from nanovllm.entrypoints.server.parsed_output import ParsedDelta
from nanovllm.entrypoints.server.tools import ChatFeatures, ChatPlan, plan_chat

if TYPE_CHECKING:
    from nanovllm.llm import LLM

MessagesBody = Annotated[MessagesRequest, Depends(json_body(MessagesRequest))]


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def add_anthropic_routes(app: FastAPI, engine: EngineLoop, llm: LLM, served_model_name: str,
                         preparers: ThreadPoolExecutor, features: ChatFeatures):
    async def plan(body: MessagesRequest) -> ChatPlan:
        return await asyncio.get_running_loop().run_in_executor(preparers, lambda: plan_chat(
            features, llm.tokenizer, body.function_tools(), body.openai_tool_choice(), body.template_kwargs(),
            body.parallel_tool_calls))

    @app.post("/v1/messages")
    async def messages(body: MessagesBody, request: Request):
        body.check(served_model_name)
        chat_plan = await plan(body)
        inputs = [{"messages": body.chat_messages(), "chat_template_kwargs": chat_plan.template_kwargs,
                   "max_tokens_is_a_cap": True}]
        streams = await submit_choices(engine, preparers, llm, inputs, chat_plan.sampling_with(body.sampling()))
        parser = chat_plan.make_parser(make_id=new_tool_use_id)
        message_id = f"msg_{uuid.uuid4().hex}"
        watch = streaming.ClientWatch(engine, streams, request)
        if body.stream:
            events = message_events(message_id, served_model_name, parser, streams[0])
            return StreamingResponse(sse(events, watch), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        last = (await streaming.collect(streams, watch))[0]
        return message_body(message_id, served_model_name, parser, last, streams[0].num_prompt_tokens)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: MessagesBody):
        body.check(served_model_name, needs_max_tokens=False)
        chat_plan = await plan(body)
        try:
            token_ids = await asyncio.get_running_loop().run_in_executor(preparers, lambda: prompt_token_ids(
                llm, None, body.chat_messages(), chat_plan.template_kwargs))
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return {"input_tokens": len(token_ids)}


def stop_reason(parser: ChatOutputParser, last: Delta) -> tuple[str | None, str | None]:
    """(Anthropic's stop_reason, stop_sequence) of a finished answer."""
    if last.finish_reason == "length":
        return "max_tokens", None
    if parser.num_calls:
        return "tool_use", None
    if isinstance(last.stop_reason, str):
        return "stop_sequence", last.stop_reason
    return "end_turn", None


def content_blocks(parsed: ParsedDelta) -> list[dict]:
    blocks = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    calls = merged_calls(parsed.tool_calls)
    if parsed.content or not (calls or blocks):
        blocks.append({"type": "text", "text": parsed.content})
    blocks.extend({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}
                  for call in calls)
    return blocks


def message_body(message_id: str, model: str, parser: ChatOutputParser, last: Delta, num_input_tokens: int) -> dict:
    """The non-streamed answer."""
    blocks = content_blocks(parser.parse_all(last.final_text))
    reason, sequence = stop_reason(parser, last)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": num_input_tokens, "output_tokens": last.num_completion_tokens}}


class BlockWriter:
    """A streamed answer's content blocks: opens a block when the kind of text changes (thinking, text, a new
    call), closes the one before. `index`: the open block's (Anthropic counts blocks from 0)."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None  # the open block's type, or None

    def events(self, parsed: ParsedDelta) -> list[tuple[str, dict]]:
        out = []
        if parsed.reasoning:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": parsed.reasoning}))
        if parsed.content:
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for call in merged_calls(parsed.tool_calls):
            if call.id is not None:  # a new call is a new block, even right after another call
                out += self._open("tool_use", {"type": "tool_use", "id": call.id, "name": call.name, "input": {}},
                                  is_new=True)
            if call.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        """Close the open block; an answer with no block at all gets an empty text block, as the non-streamed
        answer has one."""
        out = [] if self.index >= 0 else self._open("text", {"type": "text", "text": ""})
        if self.index >= 0 and self.kind is not None:
            out.append(("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return out

    def _open(self, kind: str, block: dict, is_new: bool = False) -> list[tuple[str, dict]]:
        if self.kind == kind and not is_new:
            return []
        out = [("content_block_stop", {"type": "content_block_stop", "index": self.index})] if self.kind else []
        self.index += 1
        self.kind = kind
        out.append(("content_block_start", {"type": "content_block_start", "index": self.index,
                                            "content_block": block}))
        return out

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}


async def message_events(message_id: str, model: str, parser: ChatOutputParser,
                         stream: RequestStream) -> AsyncIterator[tuple[str, dict]]:
    """(event name, data) of a streamed answer; an aborted request just ends."""
    yield "message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": stream.num_prompt_tokens, "output_tokens": 0}}}
    yield "ping", {"type": "ping"}
    writer = BlockWriter()
    async for delta in stream.events():
        if delta.finish_reason == "abort":
            return
        parsed = parser.feed(delta.text)
        if delta.finish_reason is not None:
            parsed.add(parser.finish())
        for event in writer.events(parsed):
            yield event
        if delta.finish_reason is not None:
            for event in writer.close():
                yield event
            reason, sequence = stop_reason(parser, delta)
            yield "message_delta", {"type": "message_delta",
                                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": delta.num_completion_tokens}}
            yield "message_stop", {"type": "message_stop"}


def sse(events: AsyncIterator[tuple[str, dict]], watch: streaming.ClientWatch) -> AsyncIterator[str]:
    async def body():
        try:
            async for name, data in events:
                yield f"event: {name}\ndata: {json.dumps(data)}\n\n"
        except EngineError as e:  # the status line is already sent: report it in the stream, as Anthropic does
            error = {"type": "error", "error": {"type": "api_error", "message": str(e)}}
            yield f"event: error\ndata: {json.dumps(error)}\n\n"
        finally:
            watch.close()
    return body()
