"""One chat choice's output → reasoning, content and tool calls, streamed or whole."""

from __future__ import annotations

from rollout.parsers.reasoning import ReasoningParser
from rollout.parsers.tool_call_parser import ToolCallParser
from rollout.parsers.types import (
    MessageDelta,
    ParsedMessage,
    TextAndCalls,
    call_deltas,
)


class ChatOutputParser:
    """Reasoning first, then tool calls in the answer that follows; either parser may be None.

    One instance per choice: `feed` each text delta, then `finish` once. Tool calls are
    numbered from 0 in the order they were made, as the OpenAI stream numbers them."""

    def __init__(
        self, reasoning: ReasoningParser | None = None, tool_calls: ToolCallParser | None = None
    ) -> None:
        self.reasoning = reasoning
        self.tool_calls = tool_calls
        self.calls_made = 0  # finish_reason is "tool_calls" when this is > 0 at the end

    def parse(self, text: str) -> ParsedMessage:
        """The whole output at once; does not touch this instance's stream."""
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        found = self.tool_calls.parse(content) if self.tool_calls else TextAndCalls(content)
        return ParsedMessage(found.text, reasoning or None, found.calls)

    def feed(self, delta: str) -> MessageDelta:
        reasoning, content = self.reasoning.feed(delta) if self.reasoning else ("", delta)
        return self._message(reasoning, self._calls(content, final=False))

    def finish(self) -> MessageDelta:
        """What the end of the output settles (held-back text, a call cut short as text)."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._message(reasoning, self._calls(content, final=True))

    def _calls(self, content: str, final: bool) -> TextAndCalls:
        if self.tool_calls is None:
            return TextAndCalls(content)
        found = self.tool_calls.feed(content)
        if final:
            rest = self.tool_calls.finish()
            found = TextAndCalls(found.text + rest.text, found.calls + rest.calls)
        return found

    def _message(self, reasoning: str, found: TextAndCalls) -> MessageDelta:
        delta = MessageDelta(content=found.text, reasoning_content=reasoning)
        for call in found.calls:
            delta.tool_calls.extend(call_deltas(call, self.calls_made))
            self.calls_made += 1
        return delta
