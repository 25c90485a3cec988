"""What the output parsers return: whole tool calls, streamed deltas, a parsed message."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One function call the model made; `arguments` is a JSON object serialized as a string,
    as the OpenAI API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """One streamed piece of a tool call. The first piece of call `index` carries its id and
    name (and empty arguments); later pieces carry only argument text, which a client appends."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def call_deltas(call: ToolCall, index: int) -> list[ToolCallDelta]:
    """The deltas that stream `call` as tool call number `index`: its head, then its arguments."""
    head = ToolCallDelta(index=index, arguments="", id=call.id, name=call.name)
    return [head, ToolCallDelta(index=index, arguments=call.arguments)]


@dataclass
class TextAndCalls:
    """A tool-call parser's output for a whole text, or for one streamed delta."""

    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ParsedMessage:
    """A whole assistant output split into reasoning, visible content and tool calls."""

    content: str
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def as_openai(self) -> dict[str, Any]:
        """The chat completion `message`: content is null when the model only called tools."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["content"] = self.content or None
            message["tool_calls"] = [c.as_openai() for c in self.tool_calls]
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        return message


@dataclass
class MessageDelta:
    """What one streamed text delta adds to the message; every field may be empty."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning_content or self.tool_calls)
