"""A chat choice's text -> the OpenAI message or delta: reasoning_content and tool_calls split
out by the server's --reasoning-parser and --tool-call-parser (rollout/parsers)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout.engine.grammar_openai import after_reasoning, forced_tool_names, tool_call_grammar
from rollout.engine.grammar_spec import grammar_fields
from rollout.errors import InvalidRequest
from rollout.parsers import TOOL_CALL_PARSERS, chat_output_parser
from rollout.parsers.chat_output import ChatOutputParser
from rollout.parsers.reasoning import REASONING_FORMATS, ReasoningParser
from rollout.parsers.types import MessageDelta
from rollout.server.openai_protocol import ChatCompletionRequest
from rollout.server.options import ServerOptions

Parsers = Callable[[], ChatOutputParser] | None


def check_tool_choice(body: ChatCompletionRequest, options: ServerOptions) -> None:
    """What a chat request asks of tools that this server can give, or an InvalidRequest."""
    forced_tool_names(body.tools or [], body.tool_choice)  # a choice the tools can't meet raises
    if body.tool_names() and options.tool_call_parser is None:
        raise InvalidRequest("tools need the server started with --tool-call-parser")


def force_tool_calls(body: ChatCompletionRequest, options: ServerOptions) -> ChatCompletionRequest:
    """`body` whose output is constrained to tool calls, in the --tool-call-parser's format,
    when tool_choice is "required" or names a function (one call); else `body` as it is."""
    names = forced_tool_names(body.tools or [], body.tool_choice)
    if names is None or options.tool_call_parser is None:
        return body
    if body.grammar_params():
        raise InvalidRequest(
            f"tool_choice {body.tool_choice!r} can't be combined with response_format, "
            "json_schema, regex, ebnf or structural_tag"
        )
    named = isinstance(body.tool_choice, dict)
    grammar = tool_call_grammar(
        options.tool_call_parser, body.tools or [], names, body.parallel_tool_calls, named
    )
    try:
        grammar_fields({"structural_tag": grammar})
    except InvalidRequest as e:  # a function's parameters that are no JSON schema xgrammar takes
        detail = str(e).removeprefix("structural_tag is not a valid structural tag: ")
        raise InvalidRequest(
            f"{_unusable_parameters(body.tools or [], names)} is not a usable JSON schema: {detail}"
        ) from None
    return body.model_copy(update={"structural_tag": grammar})


def _unusable_parameters(tools: list[dict[str, Any]], names: list[str]) -> str:
    """Where the first of the forced tools whose parameters xgrammar refuses has them."""
    for i, tool in enumerate(tools):
        function = tool.get("function") or {}
        if function.get("name") in names and "parameters" in function:
            try:
                grammar_fields({"json_schema": function["parameters"]})
            except InvalidRequest:
                return f"tools[{i}].function.parameters"
    return "tools: a function's parameters"  # refused only together


def grammar_after_reasoning(
    body: ChatCompletionRequest, options: ServerOptions, prompt_tail: str
) -> ChatCompletionRequest:
    """`body` whose grammar (response_format, forced tool calls, ...) applies after the
    model's reasoning, when the server has a --reasoning-parser: the reasoning is free text."""
    fields = body.grammar_params()
    if options.reasoning_parser is None or not fields:
        return body
    try:  # the grammar as the client gave it, checked before it is wrapped
        spec = grammar_fields(fields)
    except InvalidRequest as e:
        raise InvalidRequest(body.as_named(str(e))) from None
    assert spec is not None
    fields = {spec.kind: spec.text}
    fmt = REASONING_FORMATS[options.reasoning_parser]
    in_reasoning = ReasoningParser(fmt).opens_in_prompt(prompt_tail)
    if in_reasoning is None:
        in_reasoning = fmt.in_reasoning
    wrapped = after_reasoning(fields, in_reasoning, fmt.start, fmt.end)
    if wrapped == fields:
        return body
    cleared = dict.fromkeys(("response_format", "json_schema", "regex", "ebnf"))
    return body.model_copy(update={**cleared, **wrapped})


def output_parsers(
    body: ChatCompletionRequest, options: ServerOptions, prompt_tail: str
) -> Parsers:
    """A maker of one output parser per choice, or None when the text is returned as it is."""
    names = body.tool_names()
    tool_parser = options.tool_call_parser if names else None
    if tool_parser is None and options.reasoning_parser is None:
        return None
    return lambda: chat_output_parser(tool_parser, options.reasoning_parser, names, prompt_tail)


def needs_special_tokens(body: ChatCompletionRequest, options: ServerOptions) -> bool:
    """Whether the tool-call format is written in special tokens ([TOOL_CALLS], ...), which
    the text must keep for the parser to see them."""
    if not body.tool_names() or options.tool_call_parser is None:
        return False
    return TOOL_CALL_PARSERS[options.tool_call_parser].needs_special_tokens


def message(
    text: str, reason: str | None, parsers: Parsers, parallel: bool
) -> tuple[dict, str | None]:
    """The assistant message of a whole choice, and its finish reason ("tool_calls" when it
    ended by calling tools)."""
    if parsers is None:
        return {"role": "assistant", "content": text}, reason
    parsed = parsers().parse(text)
    out = parsed.as_openai()
    if out.get("tool_calls"):
        if not parallel:
            out["tool_calls"] = out["tool_calls"][:1]
        if reason == "stop":
            reason = "tool_calls"
    return out, reason


def delta(
    text: str, reason: str | None, state: dict, parsers: Parsers, parallel: bool
) -> tuple[dict, str | None]:
    """The delta of a streamed choice's new text (`state` is the choice's), and its finish
    reason."""
    if parsers is None:
        return ({"content": text} if text else {}), reason
    parser = state.setdefault("parser", parsers())
    parts = [parser.feed(text)]
    if reason is not None:
        parts.append(parser.finish())
    out: dict[str, Any] = {}
    content = "".join(p.content or "" for p in parts)
    reasoning = "".join(p.reasoning_content or "" for p in parts)
    calls = [c.as_openai() for p in parts for c in _calls(p) if parallel or c.index == 0]
    if reasoning:
        out["reasoning_content"] = reasoning
    if content:
        out["content"] = content
    if calls:
        out["tool_calls"] = calls
    if reason == "stop" and parser.calls_made:
        reason = "tool_calls"
    return out, reason


def _calls(part: MessageDelta) -> list:
    return list(part.tool_calls or ())
