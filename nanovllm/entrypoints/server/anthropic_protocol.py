"""The request body of /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), and its translation to
what the chat route already serves: OpenAI-style chat messages, function tools and a tool_choice.

Anthropic's content blocks map one to one:
- `text` -> the message's text; `thinking` (an earlier answer's) -> its `reasoning_content`;
- `tool_use` (an assistant's call) -> a `tool_calls` entry, its `input` as the arguments;
- `tool_result` (in a user turn) -> a `tool` message for that call id, ahead of the turn's text;
- `system` -> a system message. Images and documents get a 400 (text models only).
Fields this server does not use and that change nothing about the answer (metadata, cache_control on blocks,
service_tier, ...) are accepted and ignored: agent harnesses send them on every request.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from nanovllm.entrypoints.server.protocol import MAX_STOP_STRINGS, MAX_TOOLS, APIError, StopString, refuse_unencodable


class _Lenient(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")  # cache_control, citations, ...: nothing to do here


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]  # another model's encrypted reasoning: nothing this one can read


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content or [])
        return f"Error: {text}" if self.is_error else text


class OtherBlock(_Lenient):
    """An image, a document, or any block type this server does not read: refused by name."""
    model_config = ConfigDict(strict=True, extra="allow")
    type: str


Block = Annotated[TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | OtherBlock,
                  Field(union_mode="left_to_right")]


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Lenient):
    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]  # Anthropic's rule for the name
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom", or absent; a server tool (web_search, ...) is refused in `check`


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # not enforced: the model ends its reasoning itself, within max_tokens


class MessagesRequest(_Lenient):
    """Anthropic's /v1/messages body (count_tokens takes the same without max_tokens)."""
    model: str | None = None
    messages: list[Message]
    max_tokens: int | None = None  # required by /v1/messages (see `check`), not by count_tokens
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data: Any) -> Any:
        return refuse_unencodable(data)

    def check(self, served_model_name: str, needs_max_tokens: bool = True):
        """APIError naming the field for what the API refuses. A request for another model name is served by this
        model (harnesses send their own model names, e.g. claude-sonnet-4-5, and have no setting to change them)."""
        if needs_max_tokens and self.max_tokens is None:
            raise APIError(400, "max_tokens: Field required", param="max_tokens")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise APIError(400, f"max_tokens={self.max_tokens} must be >= 1", param="max_tokens")
        if not self.messages:
            raise APIError(400, "messages: at least one message is required", param="messages")
        if self.temperature is not None and not 0.0 <= self.temperature <= 1.0:  # Anthropic's range
            raise APIError(400, f"temperature={self.temperature} must be in [0, 1]", param="temperature")
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise APIError(400, f"tools.{i}: the server tool {tool.type!r} is not available here; send custom "
                                    f"tools (name, description, input_schema)", param=f"tools.{i}")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise APIError(400, "tool_choice.name is required when tool_choice.type is 'tool'", param="tool_choice")

    def chat_messages(self) -> list[dict]:
        """The conversation as OpenAI-style chat messages, for the chat template."""
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            messages.extend(_chat_messages(i, message))
        return messages

    def function_tools(self) -> list[dict] | None:
        if not self.tools:
            return None
        return [{"type": "function", "function": {"name": tool.name, "parameters": tool.input_schema,
                                                  **({"description": tool.description} if tool.description else {})}}
                for tool in self.tools]

    def openai_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            return {"type": "function", "function": {"name": choice.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[choice.type]

    def template_kwargs(self) -> dict:
        """`thinking` as Qwen3's template takes it; absent, the template's default."""
        if self.thinking is None:
            return {}
        return {"enable_thinking": self.thinking.type != "disabled"}

    def sampling(self) -> dict:
        options = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": self.top_k, "stop": self.stop_sequences}
        return {k: v for k, v in options.items() if v is not None or k == "max_tokens"}

    @property
    def parallel_tool_calls(self) -> bool | None:
        if self.tool_choice is None or self.tool_choice.disable_parallel_tool_use is None:
            return None
        return not self.tool_choice.disable_parallel_tool_use


def _chat_messages(i: int, message: Message) -> list[dict]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts, reasoning, calls, results = [], [], [], []
    for j, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input}})
        elif isinstance(block, ToolResultBlock):
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        elif isinstance(block, OtherBlock):
            raise APIError(400, f"messages.{i}.content.{j}: {block.type!r} blocks are not supported by this server "
                                f"(text, thinking, tool_use and tool_result are)", param=f"messages.{i}.content.{j}")
    if (calls or reasoning) and message.role != "assistant":
        raise APIError(400, f"messages.{i}: tool_use and thinking blocks belong to assistant messages",
                       param=f"messages.{i}")
    if results and message.role != "user":
        raise APIError(400, f"messages.{i}: tool_result blocks belong to user messages", param=f"messages.{i}")
    out = list(results)
    if texts or calls or reasoning or not results:
        chat = {"role": message.role, "content": "\n".join(texts)}
        if calls:
            chat["tool_calls"] = calls
        if reasoning:
            chat["reasoning_content"] = "\n".join(reasoning)
        out.append(chat)
    return out


def tool_input(arguments: str) -> dict:
    """A call's arguments (JSON text) as a tool_use block's `input`; arguments cut short (max_tokens) or not an
    object give {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
