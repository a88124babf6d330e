"""A chat choice's text as OpenAI's message and stream deltas: content, reasoning (vLLM's `reasoning`) and
tool_calls, read by the choice's ChatOutputParser (reasoning.py, tool_parsers.py).

A streamed call opens with `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}`-style
news, and its arguments follow as pieces of JSON text (`{"index", "function": {"arguments": "..."}}`), as OpenAI
streams them; the pieces join to the non-streamed `arguments` exactly.
"""
from __future__ import annotations

from nanovllm.entrypoints.server.reasoning import ChatOutputParser
from nanovllm.entrypoints.server.parsed_output import ToolCallDelta


def chat_message(parser: ChatOutputParser, text: str) -> dict:
    """The non-streamed message of a whole answer."""
    parsed = parser.parse_all(text)
    calls = merged_calls(parsed.tool_calls)
    # OpenAI's content is null for an answer that only calls tools
    message = {"role": "assistant", "content": parsed.content if parsed.content or not calls else None}
    if parsed.reasoning:
        message["reasoning"] = parsed.reasoning
    if calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}} for call in calls]
    return message


def chat_delta(parser: ChatOutputParser, text: str, is_last: bool) -> dict:
    """One chunk's `delta` for the answer's new text (empty when all of it is held back: a tag may be starting)."""
    parsed = parser.feed(text)
    if is_last:
        parsed.add(parser.finish())
    delta = {}
    if parsed.reasoning:
        delta["reasoning"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.tool_calls:
        delta["tool_calls"] = [call_chunk(call) for call in merged_calls(parsed.tool_calls)]
    return delta


def call_chunk(call: ToolCallDelta) -> dict:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def merged_calls(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Deltas of the same call, one after another, as one (its header, if any, first)."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and delta.id is None:
            merged[-1] = ToolCallDelta(delta.index, merged[-1].id, merged[-1].name,
                                       merged[-1].arguments + delta.arguments)
        else:
            merged.append(ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments))
    return merged
