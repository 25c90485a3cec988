"""OpenAI's ways of asking for a constrained output, as SamplingParams' grammar fields:
`response_format` (json_object, json_schema) and `tool_choice` (required, or a named function).

A forced tool call is written in the format the server's --tool-call-parser reads back, as an
xgrammar structural tag: one or more call blocks of the offered functions (each function's
arguments following its `parameters` schema), and nothing else.
"""

from __future__ import annotations

import json
from typing import Any

from rollout.errors import InvalidRequest
from rollout.parsers import TOOL_CALL_PARSERS
from rollout.parsers.hermes import CLOSE as HERMES_CLOSE
from rollout.parsers.hermes import OPEN as HERMES_OPEN
from rollout.parsers.llama3 import SEPARATOR as LLAMA3_SEPARATOR
from rollout.parsers.mistral import TOOL_CALLS as MISTRAL_TOOL_CALLS

# At most this many whitespace characters in a row inside a call's JSON: a model can't stall in
# whitespace, and a model's own spacing (one space or newline) still fits.
CALL_MAX_WHITESPACE = 1


def response_format_grammar(response_format: dict[str, Any] | None) -> dict[str, str]:
    """{grammar field: value} for a response_format: {} for text, a JSON schema otherwise."""
    if response_format is None:
        return {}
    kind = response_format.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(
                "response_format.json_schema must be an object with a 'schema' (and a 'name'), "
                f"got {spec!r}"
            )
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(
                f"response_format.json_schema.schema must be a JSON schema object, got {schema!r}"
            )
        return {"json_schema": json.dumps(schema)}
    raise InvalidRequest(
        f"response_format.type must be text, json_object or json_schema, got {kind!r}"
    )


def forced_tool_names(tools: list[dict[str, Any]], tool_choice: Any) -> list[str] | None:
    """The functions a tool_choice forces a call of (None: auto or none, nothing forced);
    raises InvalidRequest for a choice that names no offered function."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    offered = [function_of(t).get("name") for t in tools]
    if tool_choice == "required":
        if not offered:
            raise InvalidRequest("tool_choice 'required' needs at least one tool in tools")
        return offered
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in offered:
            raise InvalidRequest(
                f"tool_choice names function {name!r}, which is not among the tools "
                f"({', '.join(map(str, offered)) or 'none given'})"
            )
        return [name]
    raise InvalidRequest(
        "tool_choice must be 'auto', 'none', 'required' or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {tool_choice!r}'
    )


def tool_call_grammar(
    parser: str, tools: list[dict[str, Any]], names: list[str], parallel: bool, one: bool
) -> str:
    """The structural tag (JSON) of an output that is only calls, in `parser`'s format, of the
    functions `names`: at least one call; exactly one when `one` or not `parallel`."""
    schemas = {function_of(t).get("name"): function_of(t).get("parameters") for t in tools}
    fmt = TOOL_CALL_PARSERS[parser].name
    begin, end, separator, around = _FORMATS[fmt]
    tags = [
        {
            "type": "tag",
            "begin": begin.format(name=json.dumps(name)),
            "content": {
                "type": "json_schema",
                "json_schema": _parameters_schema(schemas.get(name)),
                "max_whitespace_cnt": CALL_MAX_WHITESPACE,
            },
            "end": end,
        }
        for name in names
    ]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": one or not parallel,
    }
    if around is not None:
        opening, closing = around
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": opening},
                calls,
                {"type": "const_string", "value": closing},
            ],
        }
    return json.dumps({"type": "structural_tag", "format": calls})


def after_reasoning(
    fields: dict[str, str], in_reasoning: bool | None, start: str, end: str
) -> dict[str, str]:
    """`fields` (one grammar field, or none) as a structural tag that first lets the model
    reason freely: up to `end` when the output starts inside its reasoning (`in_reasoning`), or
    in an optional `start`...`end` block when that is undecided (None). Unchanged when the
    output starts in the answer, or with no grammar."""
    if not fields or in_reasoning is False:
        return fields
    ((kind, text),) = fields.items()
    answer = _as_format(kind, text)
    reasoning = {
        "type": "tag",
        "begin": "" if in_reasoning else start,
        "content": {"type": "any_text"},
        "end": end,
    }
    # Models put a newline or two between the reasoning and the answer.
    gap = {"type": "regex", "pattern": r"\s{0,4}"}
    reasoned = {"type": "sequence", "elements": [reasoning, gap, answer]}
    fmt = reasoned if in_reasoning else {"type": "or", "elements": [reasoned, answer]}
    return {"structural_tag": json.dumps({"type": "structural_tag", "format": fmt})}


def _as_format(kind: str, text: str) -> dict[str, Any]:
    """A grammar field's value as a structural tag format."""
    if kind == "json_schema":
        schema = json.loads(text)
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}
    if kind == "regex":
        return {"type": "regex", "pattern": text}
    if kind == "ebnf":
        return {"type": "grammar", "grammar": text}
    tag = json.loads(text)
    if not isinstance(tag, dict) or "format" not in tag:
        raise InvalidRequest(
            f"structural_tag must be an object with a 'format', got {text[:200]!r}"
        )
    return tag["format"]


# Per parser format: a call's text before its arguments ({name} is the name as a JSON string),
# after them, between two calls, and the text around all of them (or None).
_FORMATS: dict[str, tuple[str, str, str, tuple[str, str] | None]] = {
    "hermes": (HERMES_OPEN + '\n{{"name": {name}, "arguments": ', "}\n" + HERMES_CLOSE, "\n", None),
    "qwen25": (HERMES_OPEN + '\n{{"name": {name}, "arguments": ', "}\n" + HERMES_CLOSE, "\n", None),
    "llama3": ('{{"name": {name}, "parameters": ', "}", LLAMA3_SEPARATOR + " ", None),
    "mistral": ('{{"name": {name}, "arguments": ', "}", ", ", (MISTRAL_TOOL_CALLS + " [", "]")),
}


def function_of(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    return function if isinstance(function, dict) else {}


def _parameters_schema(parameters: Any) -> Any:
    """A function's `parameters` (a JSON schema), or any object when it gives none."""
    if parameters is None:
        return {"type": "object"}
    if not isinstance(parameters, (dict, bool)):
        raise InvalidRequest(
            f"a tool's function.parameters must be a JSON schema, got {parameters!r}"
        )
    return parameters
