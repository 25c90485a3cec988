"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole output, or
after `<|python_tag|>`; several calls are separated by `;`."""

from __future__ import annotations

from rollout.parsers.text_scan import load_json, tool_calls_from
from rollout.parsers.tool_call_parser import Block, ToolCallParser, skip_space

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3ToolCallParser(ToolCallParser):
    name = "llama3"
    markers = (PYTHON_TAG,)
    needs_special_tokens = True  # <|python_tag|> is a special token

    def _find_block(self, buf: str) -> int:
        if self._after_call and buf.startswith(SEPARATOR):
            return 0
        if self._consumed == 0:  # a call may open the output without the tag
            first = skip_space(buf, 0)
            if first < len(buf) and buf[first] in "{[":
                return first
        return buf.find(PYTHON_TAG)

    def _read_block(self, buf: str, start: int, final: bool) -> Block | None:
        after = start
        if buf.startswith(PYTHON_TAG, start):
            after += len(PYTHON_TAG)
        elif buf.startswith(SEPARATOR, start):
            after += len(SEPARATOR)
        first = skip_space(buf, after)
        if first == len(buf):
            return Block(len(buf), None) if final else None
        if buf[first] not in "{[":
            return Block(after, None)  # the tag or separator is not followed by JSON
        end = self._span.end(buf[first:])
        if end is None:
            return Block(len(buf), None) if final else None
        calls = tool_calls_from(load_json(buf[first : first + end]), self.tools)
        return Block(first + end, calls)
