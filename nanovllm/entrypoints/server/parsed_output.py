"""What the output parsers (tool_parsers.py, reasoning.py) make of a model's text: answer text, reasoning text and
tool-call deltas, and the one rule they share for text that may be the start of a tag."""
from __future__ import annotations

from dataclasses import dataclass, field


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
