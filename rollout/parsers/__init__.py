"""Parsers of model output for the chat API: reasoning and tool calls, by SGLang's names.

`--reasoning-parser` takes a name in REASONING_FORMATS, `--tool-call-parser` one in
TOOL_CALL_PARSERS; `chat_output_parser` builds the parser of one chat choice from both.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout.parsers.chat_output import ChatOutputParser
from rollout.parsers.hermes import HermesToolCallParser, Qwen25ToolCallParser
from rollout.parsers.llama3 import Llama3ToolCallParser
from rollout.parsers.mistral import MistralToolCallParser
from rollout.parsers.reasoning import REASONING_FORMATS, ReasoningFormat, ReasoningParser
from rollout.parsers.tool_call_parser import ToolCallParser
from rollout.parsers.types import (
    MessageDelta,
    ParsedMessage,
    TextAndCalls,
    ToolCall,
    ToolCallDelta,
)

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolCallParser,
    "qwen25": Qwen25ToolCallParser,
    "qwen": Qwen25ToolCallParser,
    "llama3": Llama3ToolCallParser,
    "mistral": MistralToolCallParser,
}


def check_parser_names(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Raises ValueError naming the accepted choices when either name is unknown."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"tool_call_parser must be one of {sorted(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}"
        )
    if reasoning_parser is not None and reasoning_parser not in REASONING_FORMATS:
        raise ValueError(
            f"reasoning_parser must be one of {sorted(REASONING_FORMATS)}, got {reasoning_parser!r}"
        )


def tool_call_parser(name: str, tools: Iterable[str] | None = None) -> ToolCallParser:
    """A fresh parser for one output; `tools`: the function names the request offered."""
    check_parser_names(name, None)
    return TOOL_CALL_PARSERS[name](tools)


def reasoning_parser(name: str, in_reasoning: bool | None = None) -> ReasoningParser:
    """A fresh parser for one output; `in_reasoning`: see ReasoningParser.opens_in_prompt."""
    check_parser_names(None, name)
    return ReasoningParser(REASONING_FORMATS[name], in_reasoning)


def chat_output_parser(
    tool_call_parser_name: str | None,
    reasoning_parser_name: str | None,
    tools: Iterable[str] | None = None,
    prompt_tail: str = "",
) -> ChatOutputParser:
    """The parser of one chat choice. Pass `tool_call_parser_name=None` when the request offers
    no tools or says tool_choice="none"; `prompt_tail`: the last few prompt tokens decoded, which
    say whether the template opened the reasoning."""
    reasoning = None
    if reasoning_parser_name is not None:
        reasoning = reasoning_parser(reasoning_parser_name)
        opened = reasoning.opens_in_prompt(prompt_tail)
        if opened is not None:
            reasoning = reasoning_parser(reasoning_parser_name, opened)
    calls = None
    if tool_call_parser_name is not None:
        calls = tool_call_parser(tool_call_parser_name, tools)
    return ChatOutputParser(reasoning, calls)


__all__ = [
    "REASONING_FORMATS",
    "TOOL_CALL_PARSERS",
    "ChatOutputParser",
    "MessageDelta",
    "ParsedMessage",
    "ReasoningFormat",
    "ReasoningParser",
    "TextAndCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "check_parser_names",
    "chat_output_parser",
    "reasoning_parser",
    "tool_call_parser",
]
