"""Small scanning helpers shared by the output parsers."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from rollout.parsers.types import ToolCall


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`: text a
    stream must hold back, because the next delta may complete a marker."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:k]):
                best = k
                break
    return best


class JsonSpan:
    """Finds where the JSON object or array opening at text[0] closes. Called again on a longer
    text with the same start, it scans only the new characters (a stream re-asks per delta)."""

    def __init__(self) -> None:
        self._pos = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while the value is still open."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        for i in range(self._pos, len(text)):
            ch = text[i]
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
        self._pos, self._depth, self._in_string, self._escaped = (
            len(text),
            depth,
            in_string,
            escaped,
        )
        return None


def load_json(text: str) -> Any:
    """The JSON value in `text`, or None where it is not valid JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def tool_call_from(obj: Any, tools: frozenset[str] | None) -> ToolCall | None:
    """A call from a decoded `{"name": ..., "arguments"|"parameters": {...}}`, or None where the
    object is not one (wrong shape, or a function the request did not offer)."""
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name or (tools is not None and name not in tools):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as an encoded JSON string
        args = load_json(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def tool_calls_from(value: Any, tools: frozenset[str] | None) -> list[ToolCall] | None:
    """Calls from one object or a non-empty list of them; None if any of them is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = [tool_call_from(item, tools) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]
