"""A model's reasoning read out of its text as it streams: Qwen3's `<think>...</think>` (vLLM's `--reasoning-parser
qwen3`), returned apart from the answer as `reasoning` (vLLM's field name; it said `reasoning_content` before).

The reasoning is the text between `<think>` and `</think>`. A chat template may open the block itself at the end of
the prompt (Qwen3's thinking-only models do): then the answer starts inside it (`starts_in_reasoning`). A template
told `enable_thinking=False` closes an empty block in the prompt, and the answer has no tags: all of it is content.
Whitespace right after `</think>` is dropped (Qwen3 writes a blank line there). Like the tool parsers, what it
returns never depends on how the text was cut into deltas.
"""
from __future__ import annotations

from nanovllm.entrypoints.server.parsed_output import ParsedDelta, split_held
from nanovllm.entrypoints.server.tool_parsers import ToolParser

THINK_START, THINK_END = "<think>", "</think>"


class Qwen3ReasoningParser:
    """feed(text) -> (reasoning, content) of the new text; finish() -> the same for what was held back."""

    def __init__(self, starts_in_reasoning: bool = False):
        self.state = "reasoning" if starts_in_reasoning else "start"  # start, reasoning, after (the end tag), content
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        reasoning = content = ""
        text = self.held + text
        self.held = ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if THINK_START.startswith(stripped):  # all of it may still be the opening tag
                    self.held = text
                    return reasoning, content
                self.state = "reasoning" if stripped.startswith(THINK_START) else "content"
                text = stripped[len(THINK_START):] if self.state == "reasoning" else text
            elif self.state == "reasoning":
                before, tag, after = text.partition(THINK_END)
                if not tag:
                    passed, self.held = split_held(text, THINK_END)
                    return reasoning + passed, content
                reasoning += before
                self.state, text = "after", after
            elif self.state == "after":
                text = text.lstrip()
                self.state = "content" if text else "after"
            else:
                return reasoning, content + text
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The text ended: a held partial `</think>` was reasoning, a held partial `<think>` was content."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


class ChatOutputParser:
    """One choice's text through the reasoning parser (when the server has one), then the tool parser."""

    def __init__(self, tool_parser: ToolParser, reasoning_parser: Qwen3ReasoningParser | None = None):
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        # the indices of the calls sent with a name: a call the parser began but never named (a JSON object that is
        # no call) was no call, and must not make the finish reason "tool_calls"
        self._named_calls: set[int] = set()

    def feed(self, text: str) -> ParsedDelta:
        if self.reasoning_parser is None:
            return self._noted(self.tool_parser.feed(text))
        reasoning, content = self.reasoning_parser.feed(text)
        return self._noted(ParsedDelta(reasoning=reasoning).add(self.tool_parser.feed(content)))

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.reasoning_parser is not None:
            reasoning, content = self.reasoning_parser.finish()
            out.reasoning = reasoning
            out.add(self.tool_parser.feed(content))
        return self._noted(out.add(self.tool_parser.finish()))

    def _noted(self, delta: ParsedDelta) -> ParsedDelta:
        self._named_calls.update(call.index for call in delta.tool_calls if call.name is not None)
        return delta

    def parse_all(self, text: str) -> ParsedDelta:
        """A whole answer at once (the non-streamed response): the same parse as its deltas one by one."""
        return self.feed(text).add(self.finish())

    @property
    def num_calls(self) -> int:
        """The calls sent so far, each with its name."""
        return len(self._named_calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an answer that stopped after calling tools; else the engine's reason."""
        return "tool_calls" if engine_reason == "stop" and self.num_calls else engine_reason
