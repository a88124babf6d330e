"""Tool calls read out of a model's text as it streams: pure, incremental parsers (text deltas in, ParsedDelta out).

Each model family writes its calls its own way (vLLM's `--tool-call-parser` names):
- hermes (Qwen2.5, Qwen3, Hermes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, between
  ordinary text;
- llama3_json (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}` (after an optional
  `<|python_tag|>`), several joined by `;`;
- mistral: text, then `[TOOL_CALLS]` and a JSON array of `{"name": ..., "arguments": {...}}`, or (Mistral's
  tokenizers from v11) `[TOOL_CALLS]name[ARGS]{...}` per call.
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
from typing import Callable

from nanovllm.entrypoints.server.call_reader import CallReader
from nanovllm.entrypoints.server.parsed_output import ParsedDelta, ToolCallDelta, split_held


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:24]}"  # vLLM's form


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
        readers = self._readers()
        while text:
            text = readers[self.state](text, out)
        return out

    def _readers(self) -> dict:
        """state -> the method that reads text in it (each returns the text it leaves for the next state)."""
        return {"start": self._in_start, "content": self._in_content, "open": self._in_open, "calls": self._in_calls,
                "between": self._in_between, "rest": self._in_rest}

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


class MistralParser(JsonCallsParser):
    """mistral: text, then `[TOOL_CALLS]` and a JSON array of calls (Mistral's tokenizers before v11), or each call
    as `[TOOL_CALLS]name[ARGS]{arguments}` (v11 and later), with text allowed between."""

    args_tag = "[ARGS]"

    def __init__(self, make_id: Callable[[], str] = new_call_id):
        super().__init__(make_id, prefix="[TOOL_CALLS]", is_array=True, content_before=True)
        self.name_text = ""  # the v11 form: the name read so far, up to [ARGS]

    def _readers(self) -> dict:
        return {**super()._readers(), "name": self._in_name, "arguments": self._in_arguments}

    def _in_open(self, text: str, out: ParsedDelta) -> str:
        stripped = text.lstrip()
        if not stripped or stripped[0] == "[":
            return super()._in_open(text, out)
        self.state = "name"
        return stripped

    def _in_name(self, text: str, out: ParsedDelta) -> str:
        name, tag, after = (self.name_text + text).partition(self.args_tag)
        if not tag:
            self.name_text = name
            return ""
        self.name_text, self.state = "", "arguments"
        self.reader = self._new_reader()
        self.reader.ends_with_arguments = True  # no object around the arguments: they end the call
        deltas, _ = self.reader.feed(f'{{"name": {json.dumps(name.strip())}, "arguments": ')
        out.tool_calls.extend(deltas)
        return after

    def _in_arguments(self, text: str, out: ParsedDelta) -> str:
        deltas, text = self.reader.feed(text)
        out.tool_calls.extend(deltas)
        if self.reader.is_done or self.reader.is_broken:
            self.reader, self.state = None, "content"  # text, or the next [TOOL_CALLS]
        return text

    def finish(self) -> ParsedDelta:
        out = super().finish()
        out.content += self.name_text  # a name never followed by [ARGS]: it was text
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
    return MistralParser(make_id)


def required_calls_parser(make_id: Callable[[], str] = new_call_id) -> ToolParser:
    """tool_choice="required": the grammar forces a JSON array of call objects (see tools.required_calls_schema)."""
    return JsonCallsParser(make_id, is_array=True)


TOOL_PARSERS = {"hermes": hermes_parser, "llama3_json": llama3_json_parser, "mistral": mistral_parser}
