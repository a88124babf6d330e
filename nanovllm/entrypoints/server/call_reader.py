"""One tool call's JSON object read a character at a time, reported as it streams (see CallReader)."""
from __future__ import annotations

import json
from typing import Callable

from nanovllm.entrypoints.server.parsed_output import ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 writes "parameters", the others "arguments"



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
        self.ends_with_arguments = False  # the call is done when its arguments' value ends (mistral's v11 form)

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
            self.is_done = self.ends_with_arguments

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
