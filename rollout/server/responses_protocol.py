"""The request body of /v1/responses (OpenAI's Responses API), and its input items as chat
messages: what the chat template renders for models whose format is not Harmony.

Items accepted: messages (a string, or parts of input_text / output_text), function_call and
function_call_output, and reasoning (kept for Harmony; the chat template is not shown earlier
turns' reasoning). Anything else (images, files, item references, hosted tools) is a 400 that
names the item.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, Field

from rollout.engine.grammar_openai import forced_tool_names
from rollout.engine.grammar_spec import grammar_fields
from rollout.engine.request_limits import check_unicode_in
from rollout.errors import InvalidRequest, InvalidRequestType
from rollout.server.json_body import BODY_CONFIG
from rollout.text_checks import check_unicode, is_unicode

MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# The fields the Response object repeats as they were given (responses_output.response_object).
ECHOED = ("instructions", "tools", "tool_choice", "text", "reasoning", "metadata", "user")


class ResponsesRequest(BaseModel):
    model_config = BODY_CONFIG  # strict as the chat API's: "0.5" is no temperature

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None  # {"type": "function", "name", "parameters", ...}
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_schema" | ...}}
    reasoning: dict[str, Any] | None = None  # {"effort": "low" | "medium" | "high"}: Harmony's
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    # Extras, as the chat API takes them
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    rid: str | None = None

    def as_named(self, message: str) -> str:
        """An engine refusal's `message` with its fields named as this request names them (a
        Harmony model's request goes to the engine as it is)."""
        return re.sub(r"\bmax_new_tokens\b", "max_output_tokens", message)

    def check_unicode(self) -> None:
        """Raises InvalidRequest naming the first string of the input, or of a field the answer
        repeats, that no tokenizer and no JSON can hold (a lone surrogate, JSON's "\\ud800"
        without its pair): `input[2].content[0].text`, `metadata.key`."""
        for name in ("input", *ECHOED):
            check_unicode_at(getattr(self, name), name)

    def input_items(self) -> list[dict[str, Any]]:
        """The input as a list of items: a string is one user message."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return list(self.input)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools in the chat API's shape ({"type", "function": {...}})."""
        if not self.tools:
            return None
        tools = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise InvalidRequest(
                    f"tools[{i}] has type {tool.get('type')!r}; only function tools are served "
                    "here (hosted tools such as web_search or file_search are not)"
                )
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise InvalidRequest(f"tools[{i}] needs a function name")
            parameters = tool.get("parameters")
            if parameters is not None and not isinstance(parameters, (dict, bool)):
                raise InvalidRequest(
                    f"tools[{i}].parameters must be a JSON schema object, got {parameters!r:.100}"
                )
            function = {"name": tool["name"]}
            for key in ("description", "parameters", "strict"):
                if tool.get(key) is not None:
                    function[key] = tool[key]
            tools.append({"type": "function", "function": function})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any]:
        """tool_choice in the chat API's shape."""
        choice = self.tool_choice
        if isinstance(choice, str):
            if choice not in ("auto", "none", "required"):
                raise InvalidRequest(
                    f"tool_choice must be auto, none, required or a function, got {choice!r}"
                )
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest(
                'tool_choice must name a function as {"type": "function", "name": ...}, got '
                f"{choice!r}"
            )
        return {"type": "function", "function": {"name": choice["name"]}}

    def response_format(self) -> dict[str, Any] | None:
        """text.format as the chat API's response_format (None: plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is not None and not isinstance(fmt, dict):
            raise InvalidRequestType('text.format must be an object: {"type": "text", ...}')
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), (dict, bool)):
                raise InvalidRequest(
                    "text.format.schema must be a JSON schema object (type json_schema needs "
                    f"one), got {fmt.get('schema')!r:.100}"
                )
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": schema}
        raise InvalidRequest(
            f"text.format.type must be text, json_object or json_schema, got {fmt.get('type')!r}"
        )

    def check_text_format(self) -> None:
        """Raises InvalidRequest, naming text.format, for a format the chat route would refuse
        under its own names (response_format): a schema xgrammar can't constrain output to,
        or a format alongside a forced tool call. Compiles the schema: run off the event loop."""
        chat_format = self.response_format()
        if chat_format is None:
            return
        kind = chat_format["type"]
        if forced_tool_names(self.chat_tools() or [], self.chat_tool_choice()) is not None:
            raise InvalidRequest(
                f"tool_choice {self.tool_choice!r} can't be combined with text.format {kind!r}: "
                "a forced tool call's output is the call"
            )
        field, schema = "text.format", {"type": "object"}
        if kind == "json_schema":
            field, schema = "text.format.schema", chat_format["json_schema"]["schema"]
        try:
            grammar_fields({"json_schema": schema})
        except InvalidRequest as e:  # its messages start with the grammar field's name
            raise InvalidRequest(field + str(e).removeprefix("json_schema")) from None


def item_text(content: Any, where: str, field: str = "content") -> str:
    """The text of a message's content (a function call output's `output`): a string, or a
    list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestType(f"{where}.{field} must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequest(
                f"{where}.{field}[{j}] has type {kind!r}; only text parts ({', '.join(TEXT_PARTS)})"
                " are served here"
            )
        texts.append(part["text"])
    return "".join(texts)


def check_unicode_at(value: Any, where: str) -> None:
    """Raises InvalidRequest naming the path (`where[2].content[0].text`) of the first string
    in a JSON-like `value`, keys included, that is not valid Unicode."""
    try:
        check_unicode_in(value, where)
        return
    except InvalidRequest:
        pass  # there is one: walk again, keeping paths, to name it
    stack: list[tuple[Any, Any]] = [(value, where)]
    while stack:  # iterative: JSON can nest deeper than Python recurses
        item, path = stack.pop()
        if isinstance(item, str):
            if not is_unicode(item):
                check_unicode(item, _path(path))
        elif isinstance(item, dict):
            for key in item:
                if isinstance(key, str) and not is_unicode(key):
                    check_unicode(key, f"a key of {_path(path)}")
            # (parent's path, key): made into text only for the error.
            stack.extend((v, (path, k)) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, (path, i)) for i, v in reversed(list(enumerate(item))))


def _path(path: Any) -> str:
    parts = []
    while isinstance(path, tuple):
        path, key = path
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return path + "".join(reversed(parts))


def check_items(items: list[dict[str, Any]]) -> None:
    """Raises InvalidRequest naming the first item this server can't take."""
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestType(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in MESSAGE_ROLES:
                raise InvalidRequest(
                    f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {item.get('role')!r}"
                )
            item_text(item.get("content", ""), where)
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise InvalidRequest(f"{where} (function_call) needs a string {key}")
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where} (function_call_output) needs a string call_id")
            item_text(item.get("output"), where, "output")
        elif kind != "reasoning":
            raise InvalidRequest(
                f"{where} has type {kind!r}; the items served here are message, function_call, "
                "function_call_output and reasoning"
            )


def chat_messages(items: list[dict[str, Any]], instructions: str | None) -> list[dict[str, Any]]:
    """Checked items as chat messages (ChatMessage fields): consecutive assistant text and
    function calls become one assistant message with tool_calls, as chat templates expect."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        last = messages[-1] if messages else None
        if kind == "message":
            text = item_text(item.get("content", ""), f"input[{i}]")
            messages.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item_text(item.get("output"), f"input[{i}]", "output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    if all(m["role"] == "system" for m in messages):
        raise InvalidRequest("input has no message to answer (only instructions, or nothing)")
    return messages
