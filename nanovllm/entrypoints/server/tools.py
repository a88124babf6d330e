"""A chat request's tools and reasoning, decided before it runs: what the chat template gets, which grammar forces a
call, and which parser reads the answer.

Server-wide (ChatFeatures, from `nanovllm serve`'s options and the model's chat template):
- the tool-call parser: `--tool-call-parser hermes|llama3_json|mistral`, or found in the template (a template that
  writes `<tool_call>` is hermes, `[TOOL_CALLS]` mistral, `<|python_tag|>` llama3_json);
- the reasoning parser: `--reasoning-parser qwen3`, or qwen3 where the template writes `<think>`.
Per request (ChatPlan), by tool_choice (OpenAI's, as vLLM serves it):
- "none": the tools go to the template, the answer is text;
- "auto" (the default with tools): the model chooses; the family's parser finds the calls;
- "required": a grammar forces a JSON array of one or more `{"name", "parameters"}` objects;
- a named function: a grammar forces its arguments object.
With a reasoning parser, a forced call's grammar lets the model reason first: it applies once `</think>` ends the
reasoning (forced_call_grammar).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

from nanovllm.entrypoints.server.protocol import APIError
from nanovllm.entrypoints.server.reasoning import THINK_END, THINK_START, ChatOutputParser, Qwen3ReasoningParser
from nanovllm.entrypoints.server.tool_parsers import (TOOL_PARSERS, NamedCallParser, NoToolParser, ToolParser,
                                                      new_call_id, required_calls_parser)
from nanovllm.sampling_params import StructuredOutputsParams

REASONING_PARSERS = ("qwen3",)
# what a template writes, in the order checked -> the parser that reads it
TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"))
# parsers whose markers are special tokens, which the detokenizer drops unless told to keep them
KEEPS_SPECIAL_TOKENS = ("mistral", "llama3_json")
_PROBE = [{"role": "user", "content": "?"}]  # a conversation to see how the template ends a prompt


@dataclass
class ChatFeatures:
    """What the server does with tools and reasoning, for every chat request. `tool_call_parser` None: tools are
    refused (the template has no tool format this server reads); `reasoning_parser` None: `<think>` stays in the
    content."""
    tool_call_parser: str | None
    reasoning_parser: str | None
    chat_template: str | None = None
    _opens_reasoning: dict = field(default_factory=dict, init=False, repr=False)  # kwargs (JSON) -> opens <think>?

    @classmethod
    def resolve(cls, chat_template: str | None, tool_call_parser: str = "auto",
                reasoning_parser: str = "auto") -> ChatFeatures:
        """"auto": from the template; "none": off. ValueError naming the option for a name this server lacks."""
        if tool_call_parser not in (*TOOL_PARSERS, "auto", "none"):
            raise ValueError(f"--tool-call-parser {tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}, "
                             f"auto or none")
        if reasoning_parser not in (*REASONING_PARSERS, "auto", "none"):
            raise ValueError(f"--reasoning-parser {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}, "
                             f"auto or none")
        template = chat_template or ""
        if tool_call_parser == "auto":
            tool_call_parser = next((name for marker, name in TEMPLATE_MARKERS if marker in template), "none")
        if reasoning_parser == "auto":
            reasoning_parser = "qwen3" if THINK_START in template else "none"
        return cls(None if tool_call_parser == "none" else tool_call_parser,
                   None if reasoning_parser == "none" else reasoning_parser, chat_template)

    @property
    def template_takes_tools(self) -> bool:
        return "tools" in (self.chat_template or "")

    def opens_reasoning(self, tokenizer, template_kwargs: dict) -> bool:
        """Does the template end the prompt inside an open `<think>` (a thinking-only template), with these kwargs?
        Rendered once per distinct kwargs."""
        if self.reasoning_parser is None:
            return False
        key = json.dumps({k: v for k, v in template_kwargs.items() if k != "tools"}, sort_keys=True, default=str)
        if key not in self._opens_reasoning:
            from jinja2 import TemplateError
            try:
                text = tokenizer.apply_chat_template(_PROBE, tokenize=False, add_generation_prompt=True,
                                                     **template_kwargs)
            except TemplateError:  # the template wants more than the probe: the request's own render will say
                return False
            tail = text.rstrip()
            self._opens_reasoning[key] = tail.rfind(THINK_START) > tail.rfind(THINK_END)
        return self._opens_reasoning[key]


@dataclass
class ChatPlan:
    """One request's: the chat template's extra kwargs, its sampling options, and a parser per choice."""
    template_kwargs: dict
    sampling: dict
    make_tool_parser: Callable[..., ToolParser]  # called with make_id=
    has_reasoning: bool
    starts_in_reasoning: bool = False  # the prompt ends inside an open <think> (see ChatFeatures.opens_reasoning)

    def sampling_with(self, options: dict) -> dict:
        """The request's sampling options with the plan's; APIError when both constrain the answer (a forced call's
        grammar and response_format / structured_outputs)."""
        if "structured_outputs" in options and "structured_outputs" in self.sampling:
            raise APIError(400, "tool_choice: a required or named tool call sets the answer's grammar; it cannot be "
                                "combined with response_format or structured_outputs", param="tool_choice")
        return {**options, **self.sampling}

    def make_parser(self, make_id: Callable[[], str] = new_call_id) -> ChatOutputParser:
        """`make_id`: the calls' ids (Anthropic's routes give theirs)."""
        reasoning = Qwen3ReasoningParser(self.starts_in_reasoning) if self.has_reasoning else None
        return ChatOutputParser(self.make_tool_parser(make_id=make_id), reasoning)


def plan_chat(features: ChatFeatures, tokenizer, tools: list[dict] | None, tool_choice: str | dict | None,
              chat_template_kwargs: dict | None, parallel_tool_calls: bool | None = None) -> ChatPlan:
    """The plan of a chat request (`tools`: OpenAI's function tools as dicts). APIError 400 naming the field for a
    tool_choice that names no tool, tools without a tool template, and the like."""
    kwargs = dict(chat_template_kwargs or {})
    if "tools" in kwargs:
        raise APIError(400, "chat_template_kwargs.tools: send the tools in the request's `tools` field",
                       param="chat_template_kwargs")
    choice = check_tool_choice(tools, tool_choice)
    sampling: dict = {}
    make_tool_parser: Callable[..., ToolParser] = NoToolParser
    if tools:
        if features.tool_call_parser is None or not features.template_takes_tools:
            raise APIError(400, "tools: this model's chat template does not take tools, or has no tool-call format "
                                "this server reads (--tool-call-parser hermes|llama3_json|mistral)", param="tools")
        kwargs["tools"] = tools
        if features.tool_call_parser in KEEPS_SPECIAL_TOKENS:
            sampling["skip_special_tokens"] = False
    forced_schema = None
    if choice == "auto":
        make_tool_parser = TOOL_PARSERS[features.tool_call_parser]
    elif choice == "required":
        forced_schema = required_calls_schema(tools, parallel_tool_calls)
        make_tool_parser = required_calls_parser
    elif isinstance(choice, dict):  # a named function: its tool
        forced_schema = arguments_schema(choice)
        make_tool_parser = partial(NamedCallParser, choice["function"]["name"])
    has_reasoning = features.reasoning_parser is not None
    plan = ChatPlan(kwargs, sampling, make_tool_parser, has_reasoning)
    plan.starts_in_reasoning = has_reasoning and features.opens_reasoning(tokenizer, kwargs)
    if forced_schema is not None:
        may_think = has_reasoning and kwargs.get("enable_thinking") is not False  # False: the prompt closed it
        sampling["structured_outputs"] = forced_call_grammar(forced_schema, may_think, plan.starts_in_reasoning)
    return plan


def forced_call_grammar(schema: dict, may_think: bool, starts_in_reasoning: bool) -> StructuredOutputsParams:
    """The schema alone; where the model may think, the schema after its reasoning (the grammar applies once the
    reasoning ends, as vLLM applies it): an optional `<think>...</think>` block, or the rest of one the prompt opened,
    then the JSON. `[lazy]` ends the reasoning at the first `</think>` (llguidance's Lark)."""
    if not may_think:
        return StructuredOutputsParams(json=schema)
    reasoning = "reasoning" if starts_in_reasoning else f"({json.dumps(THINK_START)} reasoning)?"
    return StructuredOutputsParams(grammar="\n".join([
        "%llguidance {}",
        f"start: {reasoning} /[ \\t\\r\\n]*/ answer",
        f"reasoning[lazy]: /(.|\\n)*/ {json.dumps(THINK_END)}",
        f"answer: %json {json.dumps(schema)}"]))


def check_tool_choice(tools: list[dict] | None, tool_choice: str | dict | None) -> str | dict:
    """tool_choice resolved: "none", "auto", "required", or the named function's tool. OpenAI's default is "auto"
    with tools and "none" without."""
    if tool_choice is None or tool_choice == "auto":  # "auto" without tools (clients send it by default): none
        return "auto" if tools else "none"
    if tool_choice == "none":
        return "none"
    if not tools:
        raise APIError(400, f"tool_choice={tool_choice!r} needs tools: the request has none", param="tool_choice")
    if isinstance(tool_choice, str):
        return tool_choice
    name = tool_choice["function"]["name"]
    for tool in tools:
        if tool["function"]["name"] == name:
            return tool
    raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                        f"({', '.join(repr(t['function']['name']) for t in tools)})", param="tool_choice")


def arguments_schema(tool: dict) -> dict:
    """A function's parameters schema; a function without one takes an object."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def required_calls_schema(tools: list[dict], parallel_tool_calls: bool | None = None) -> dict:
    """tool_choice="required": a JSON array of at least one call of the given tools (vLLM's shape: "name" and
    "parameters"); one call only when parallel_tool_calls is false."""
    calls = [{"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                               "parameters": arguments_schema(tool)},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema

