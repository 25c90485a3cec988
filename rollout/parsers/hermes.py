"""Qwen2.5 / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
one block per call, as many blocks as calls."""

from __future__ import annotations

from rollout.parsers.text_scan import load_json, tool_calls_from
from rollout.parsers.tool_call_parser import Block, ToolCallParser
from rollout.parsers.types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolCallParser(ToolCallParser):
    name = "hermes"
    markers = (OPEN,)
    # Hermes checkpoints register <tool_call> as a special token; Qwen2.5's is a plain one.
    needs_special_tokens = True

    def _find_block(self, buf: str) -> int:
        return buf.find(OPEN)

    def _read_block(self, buf: str, start: int, final: bool) -> Block | None:
        body = start + len(OPEN)
        close = buf.find(CLOSE, body)
        if close >= 0:
            return Block(close + len(CLOSE), self._calls(buf[body:close]))
        if not final:
            return None
        # The output stopped before the closing tag (a stop string, max_tokens): a complete
        # call in the block still counts.
        return Block(len(buf), self._calls(buf[body:]))

    def _calls(self, body: str) -> list[ToolCall] | None:
        calls = tool_calls_from(load_json(body), self.tools)
        return calls if calls is not None and len(calls) == 1 else None


class Qwen25ToolCallParser(HermesToolCallParser):
    name = "qwen25"
    needs_special_tokens = False
