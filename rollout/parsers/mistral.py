"""Mistral tool calls: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`, and the newer
tokenizers' `[TOOL_CALLS]name[ARGS]{...}` (one marker per call)."""

from __future__ import annotations

import re

from rollout.parsers.text_scan import load_json, tool_call_from, tool_calls_from
from rollout.parsers.tool_call_parser import Block, ToolCallParser, skip_space

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[\w.\-]*")


class MistralToolCallParser(ToolCallParser):
    name = "mistral"
    markers = (TOOL_CALLS,)
    needs_special_tokens = True  # [TOOL_CALLS] and [ARGS] are control tokens

    def _find_block(self, buf: str) -> int:
        return buf.find(TOOL_CALLS)

    def _read_block(self, buf: str, start: int, final: bool) -> Block | None:
        after = start + len(TOOL_CALLS)
        first = skip_space(buf, after)
        if first == len(buf):
            return Block(len(buf), None) if final else None
        if buf[first] in "[{":
            end = self._span.end(buf[first:])
            if end is None:
                return Block(len(buf), None) if final else None
            return Block(
                first + end, tool_calls_from(load_json(buf[first : first + end]), self.tools)
            )
        return self._read_named(buf, after, first, final)

    def _read_named(self, buf: str, after: int, first: int, final: bool) -> Block | None:
        name_end = _NAME.match(buf, first).end()  # type: ignore[union-attr]
        rest = buf[name_end:]
        if not rest.startswith(ARGS):
            if not final and ARGS.startswith(rest):
                return None  # the name, or the [ARGS] marker, is still being written
            return Block(after, None)
        args = skip_space(buf, name_end + len(ARGS))
        if args == len(buf):
            return Block(len(buf), None) if final else None
        if buf[args] != "{":
            return Block(args, None)
        end = self._span.end(buf[args:])
        if end is None:
            return Block(len(buf), None) if final else None
        call = tool_call_from(
            {"name": buf[first:name_end], "arguments": load_json(buf[args : args + end])},
            self.tools,
        )
        return Block(args + end, None if call is None else [call])
