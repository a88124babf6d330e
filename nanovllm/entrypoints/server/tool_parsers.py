"""Tool calls read out of a model's text as it streams: pure, incremental parsers (text deltas in, ParsedDelta out).

Each model family writes its calls its own way (vLLM's `--tool-call-parser` names):
- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, between
  ordinary text;
- llama3_json (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several joined by `;`;
- mistral: text, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`.
And two shapes the server forces with a grammar (tools.py): a named function's arguments object alone, and
`tool_choice="required"`'s JSON array of `{"name": ..., "parameters": {...}}` (as vLLM forces them).

NOTE: what `feed` returns depends only on the text so far, never on how it was cut into deltas: text that may be the
start of a tag is held back until the next delta says, and a call's arguments stream as the model writes them
(their raw JSON text, so the streamed pieces join to exactly the non-streamed `arguments`). The non-streamed answer
is the same parser fed the whole text at once.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters", the others "arguments"


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"  # vLLM's form


@dataclass
class ToolCallDelta:
    """One call's news: its first delta has `id` and `name` (OpenAI's first chunk of a call), later ones carry
    more of `arguments` (JSON text)."""
    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    """What the model's new text turned out to be: answer text, reasoning text, and tool-call deltas."""
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self

    @property
    def is_empty(self) -> bool:
        return not (self.content or self.reasoning or self.tool_calls)


def split_held(text: str, tag: str) -> tuple[str, str]:
    """(text safe to pass on, its tail that may be the start of `tag`): the longest suffix of `text` that is a proper
    prefix of `tag` waits for the next delta."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size], text[-size:]
    return text, ""


class CallReader:
    """Reads one JSON object `{"name": "...", "arguments": {...}}` a character at a time and reports the call as
    it goes: its name once the name's string closes, then the arguments' raw text as it arrives (held until the name
    is known, when "arguments" comes first). `is_done` once the object closes; `is_broken` when the text is not such
    an object (the caller decides what that text becomes).

    Top-level tracking only: depth, strings and escapes, the key being read and where its value began.
    """

    def __init__(self, index: int, make_id: Callable[[], str]):
        self.index = index
        self.make_id = make_id
        self.text = ""
        self.depth = 0
        self.in_string = False
        self.is_escaped = False
        self.expects_key = True  # at depth 1: a key comes next (after `{` or `,`), else a value (after `:`)
        self.key: str | None = None
        self.token_start: int | None = None  # where the depth-1 string or value being read began
        self.name: str | None = None
        self.arguments_start: int | None = None
        self.arguments_end: int | None = None
        self.num_arguments_sent = 0
        self.has_sent_header = False
        self.is_done = False
        self.is_broken = False

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str]:
        """(the deltas of this call, the text after the object's end: not this reader's)."""
        for i, char in enumerate(text):
            if self.is_done or self.is_broken:
                return self._deltas(), text[i:]
            self._read(char)
        return self._deltas(), ""

    def finish(self) -> list[ToolCallDelta]:
        """The text ended: a call whose name is known but whose arguments never began gets `{}`."""
        deltas = self._deltas()
        if self.name is not None and self.arguments_start is None and not self.is_broken:
            deltas.append(ToolCallDelta(self.index, arguments="{}"))
        return deltas

    def _read(self, char: str):
        position = len(self.text)
        self.text += char
        if self.in_string:
            if self.is_escaped:
                self.is_escaped = False
            elif char == "\\":
                self.is_escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1:
                    self._end_string()
            return
        if self.depth == 0:
            if char == "{":
                self.depth = 1
            elif not char.isspace():
                self.is_broken = True
            return
        if char == '"':
            self.in_string = True
            if self.depth == 1:
                self._start_token(position)
        elif char in "{[":
            if self.depth == 1:
                self._start_token(position)
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            if self.depth == 1 and self.token_start is not None:
                self._end_value(position + 1)
            elif self.depth == 0:
                self._end_scalar(position)
                self.is_done = True
        elif self.depth == 1:
            self._read_top_level(char, position)

    def _read_top_level(self, char: str, position: int):
        if char == ":":
            self.expects_key = False
        elif char == ",":
            self._end_scalar(position)
            self.expects_key = True
        elif not char.isspace() and self.token_start is None:
            self._start_token(position)  # a number, true, false or null

    def _start_token(self, position: int):
        self.token_start = position
        if not self.expects_key and self.key in ARGUMENT_KEYS and self.arguments_start is None:
            self.arguments_start = position

    def _end_string(self):
        if self.expects_key:
            self.key = json.loads(self.text[self.token_start:])
            self.token_start = None
        else:
            self._end_value(len(self.text))

    def _end_scalar(self, position: int):
        if self.token_start is not None and not self.expects_key:
            self._end_value(position)

    def _end_value(self, end: int):
        raw = self.text[self.token_start:end]
        self.token_start = None
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(raw)
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) else None
            self.is_broken = self.name is None
        elif self.key in ARGUMENT_KEYS and self.arguments_start is not None and self.arguments_end is None:
            self.arguments_end = end

    def _deltas(self) -> list[ToolCallDelta]:
        if self.name is None:
            return []
        deltas = []
        if not self.has_sent_header:
            self.has_sent_header = True
            deltas.append(ToolCallDelta(self.index, id=self.make_id(), name=self.name))
        if self.arguments_start is not None:
            end = self.arguments_end if self.arguments_end is not None else len(self.text)
            new = self.text[self.arguments_start + self.num_arguments_sent:end]
            if new:
                self.num_arguments_sent += len(new)
                if deltas:
                    deltas[0].arguments = new
                else:
                    deltas.append(ToolCallDelta(self.index, arguments=new))
        return deltas


class ToolParser:
    """The interface: `feed(text)` each new piece of the model's text, `finish()` when it ends; each returns what
    the text turned out to be. `num_calls`: the calls found so far."""

    def __init__(self, make_id: Callable[[], str] = new_call_id):
        self.make_id = make_id
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    def _new_reader(self) -> CallReader:
        self.num_calls += 1
        return CallReader(self.num_calls - 1, self.make_id)


class NoToolParser(ToolParser):
    """No tools in the request: all text is content."""

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(content=text)


class TaggedCallsParser(ToolParser):
    """Text with calls between an open and a close tag (hermes: `<tool_call>` ... `</tool_call>`). A call whose
    object is malformed is passed on as content, from where it went wrong."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def __init__(self, make_id: Callable[[], str] = new_call_id):
        super().__init__(make_id)
        self.held = ""  # text that may be the start of a tag
        self.reader: CallReader | None = None
        self.is_closing = False  # a call's object has ended: its close tag comes next
        self.is_after_call = False  # whitespace after a close tag is dropped (models put a newline between calls)

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        text = self.held + text
        self.held = ""
        while text:
            if self.is_closing:
                text = self._skip_close_tag(text)
            elif self.is_after_call:
                text = text.lstrip()
                self.is_after_call = not text
            elif self.reader is not None:
                deltas, text = self.reader.feed(text)
                out.tool_calls.extend(deltas)
                if self.reader.is_broken:
                    out.content += self.reader.text
                    self.reader = None
                elif self.reader.is_done:
                    self.reader, self.is_closing = None, True
            else:
                before, tag, after = text.partition(self.open_tag)
                if not tag:
                    passed, self.held = split_held(text, self.open_tag)
                    out.content += passed
                    return out
                out.content += before
                self.reader, text = self._new_reader(), after
        return out

    def _skip_close_tag(self, text: str) -> str:
        stripped = text.lstrip()
        if self.close_tag.startswith(stripped):  # all of it may still be the tag: wait for more
            self.held = text
            return ""
        self.is_closing, self.is_after_call = False, True
        return stripped[len(self.close_tag):] if stripped.startswith(self.close_tag) else stripped

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.reader is not None:
            out.tool_calls.extend(self.reader.finish())
            if self.reader.name is None:  # cut off before its name: nothing of it went out as a call
                out.content += self.reader.text
        elif not self.is_closing:
            out.content += self.held
        return out


class JsonCallsParser(ToolParser):
    """An answer that is a call object, or several: `prefix` (which may be absent), then objects joined by
    `separator` (llama3_json: `<|python_tag|>` and `;`), or a JSON array of them (`is_array`: mistral after
    `[TOOL_CALLS]`, and tool_choice="required"). Text before the prefix is content where `content_before` (mistral);
    otherwise an answer that does not start as a call is all content."""

    def __init__(self, make_id: Callable[[], str] = new_call_id, prefix: str = "", separator: str = ",",
                 is_array: bool = False, content_before: bool = False):
        super().__init__(make_id)
        self.prefix, self.separator, self.is_array, self.content_before = prefix, separator, is_array, content_before
        self.state = "content" if content_before else "start"  # start, content, open, calls, between, rest
        self.held = ""
        self.reader: CallReader | None = None

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        text = self.held + text
        self.held = ""
        while text:
            text = getattr(self, f"_in_{self.state}")(text, out)
        return out

    def _in_start(self, text: str, out: ParsedDelta) -> str:
        stripped = text.lstrip()
        if not stripped or (self.prefix and self.prefix.startswith(stripped)):
            self.held = text
            return ""
        if self.prefix and stripped.startswith(self.prefix):
            stripped = stripped[len(self.prefix):]
        self.state = "open"
        return stripped

    def _in_content(self, text: str, out: ParsedDelta) -> str:
        if not self.content_before:  # the answer did not start as a call: it is all text
            out.content += text
            return ""
        before, tag, after = text.partition(self.prefix)
        if not tag:
            passed, self.held = split_held(text, self.prefix)
            out.content += passed
            return ""
        out.content += before
        self.state = "open"
        return after

    def _in_open(self, text: str, out: ParsedDelta) -> str:
        stripped = text.lstrip()
        if not stripped:
            return ""
        opener = "[" if self.is_array else "{"
        if stripped[0] != opener:
            self.state, self.content_before = "content", False
            return stripped
        self.state = "calls"
        self.reader = self._new_reader()
        return stripped[1:] if self.is_array else stripped

    def _in_calls(self, text: str, out: ParsedDelta) -> str:
        if self.reader is None:
            stripped = text.lstrip()
            if not stripped:
                return ""
            self.reader = self._new_reader()
            text = stripped
        deltas, text = self.reader.feed(text)
        out.tool_calls.extend(deltas)
        if self.reader.is_broken:
            out.content += self.reader.text
            self.reader, self.state, self.content_before = None, "content", False
        elif self.reader.is_done:
            self.reader, self.state = None, "between"
        return text

    def _in_between(self, text: str, out: ParsedDelta) -> str:
        stripped = text.lstrip()
        if not stripped:
            return ""
        if stripped.startswith(self.separator):
            self.state = "calls"
            return stripped[len(self.separator):]
        self.state = "rest"
        return stripped[1:] if self.is_array and stripped[0] == "]" else stripped

    def _in_rest(self, text: str, out: ParsedDelta) -> str:
        out.content += text  # after the calls: what a model adds is passed on as text
        return ""

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.reader is not None:
            out.tool_calls.extend(self.reader.finish())
            if self.reader.name is None:
                out.content += self.reader.text
        elif self.state in ("start", "content"):
            out.content += self.held
        return out


class NamedCallParser(ToolParser):
    """tool_choice names a function: the grammar makes the whole answer its arguments object, so every piece of text
    is more of the arguments of call 0."""

    def __init__(self, name: str, make_id: Callable[[], str] = new_call_id):
        super().__init__(make_id)
        self.name = name

    def feed(self, text: str) -> ParsedDelta:
        if self.num_calls == 0:
            self.num_calls = 1
            return ParsedDelta(tool_calls=[ToolCallDelta(0, id=self.make_id(), name=self.name, arguments=text)])
        return ParsedDelta(tool_calls=[ToolCallDelta(0, arguments=text)] if text else [])


def hermes_parser(make_id: Callable[[], str] = new_call_id) -> ToolParser:
    return TaggedCallsParser(make_id)


def llama3_json_parser(make_id: Callable[[], str] = new_call_id) -> ToolParser:
    return JsonCallsParser(make_id, prefix="<|python_tag|>", separator=";")


def mistral_parser(make_id: Callable[[], str] = new_call_id) -> ToolParser:
    return JsonCallsParser(make_id, prefix="[TOOL_CALLS]", is_array=True, content_before=True)


def required_calls_parser(make_id: Callable[[], str] = new_call_id) -> ToolParser:
    """tool_choice="required": the grammar forces a JSON array of call objects (see tools.required_calls_schema)."""
    return JsonCallsParser(make_id, is_array=True)


TOOL_PARSERS = {"hermes": hermes_parser, "llama3_json": llama3_json_parser, "mistral": mistral_parser}
