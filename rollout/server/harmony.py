"""Harmony, the chat format of gpt-oss, through the `openai-harmony` package (the harmony
extra): a Responses conversation rendered to prompt ids, and the model's output ids parsed
into chat-shaped deltas (reasoning_content, content, tool_calls) as the chat route's parsers
give them.

openai-harmony reads its vocabulary (o200k_base.tiktoken) from the directory named by
TIKTOKEN_ENCODINGS_BASE, else downloads it once into its cache (TIKTOKEN_RS_CACHE_DIR): a
machine without internet needs that file put there beforehand (the package checks its hash).
"""

from __future__ import annotations

import functools
from typing import Any

from rollout.errors import InvalidRequest
from rollout.parsers.types import new_call_id
from rollout.server.responses_protocol import ResponsesRequest, item_text

HARMONY_MARKER = "<|channel|>"  # in the chat template of every Harmony model, and no other
FUNCTIONS = "functions."


class HarmonyUnavailable(RuntimeError):
    """This server's model writes Harmony, and openai-harmony or its vocabulary is missing."""


def is_harmony_template(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes Harmony (gpt-oss)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return isinstance(template, str) and HARMONY_MARKER in template


def encoding() -> Any:
    """The gpt-oss Harmony encoding; HarmonyUnavailable says what is missing."""
    loaded = load_encoding()
    if isinstance(loaded, HarmonyUnavailable):
        raise loaded
    return loaded


@functools.cache
def load_encoding() -> Any:
    """The encoding, or the HarmonyUnavailable that says why not: a failure is kept too, so
    that a machine without the vocabulary does not try to download it on every request
    (load_encoding.cache_clear() tries again)."""
    try:
        import openai_harmony as oh
    except ImportError:
        return HarmonyUnavailable(
            "this model's chat format is Harmony: /v1/responses needs the openai-harmony package "
            "(pip install 'rollout[harmony]')"
        )
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception as e:  # noqa: BLE001 - HarmonyError: a missing or unreachable vocabulary
        return HarmonyUnavailable(
            f"openai-harmony could not load its vocabulary ({e}); without internet, put "
            "o200k_base.tiktoken in a directory and name it in TIKTOKEN_ENCODINGS_BASE"
        )


def check_request(body: ResponsesRequest) -> None:
    """What the Harmony path does not serve: forced tool calls and constrained text."""
    if body.tool_choice not in ("auto", "none"):
        raise InvalidRequest(
            f"tool_choice {body.tool_choice!r} is not served for Harmony models (auto or none)"
        )
    if body.response_format() is not None:
        raise InvalidRequest("text.format other than text is not served for Harmony models")


def render(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> list[int]:
    """The prompt ids of `conversation` (checked items) ending where the assistant writes."""
    try:
        return _render(body, conversation)
    except InvalidRequest:
        raise
    except Exception as e:  # noqa: BLE001 - openai-harmony refusing the caller's items or tools
        raise InvalidRequest(f"these items can't be rendered in Harmony: {e}") from e


def _render(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> list[int]:
    import openai_harmony as oh

    enc = encoding()
    system = oh.SystemContent.new()
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        if effort not in ("low", "medium", "high"):
            raise InvalidRequest(f"reasoning.effort must be low, medium or high, got {effort!r}")
        system = system.with_reasoning_effort(oh.ReasoningEffort(effort.capitalize()))
    messages = [oh.Message.from_role_and_content(oh.Role.SYSTEM, system)]
    developer = _developer(body)
    if developer is not None:
        messages.append(oh.Message.from_role_and_content(oh.Role.DEVELOPER, developer))
    names = {}  # call_id -> function name, for the outputs that answer them
    for i, item in enumerate(conversation):
        kind = item.get("type", "message")
        if kind == "function_call":
            names[item["call_id"]] = item["name"]
        messages.append(_message(oh, item, names, f"input[{i}]"))
    conv = oh.Conversation.from_messages(messages)
    return enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT)


def _developer(body: ResponsesRequest) -> Any:
    import openai_harmony as oh

    tools = [
        oh.ToolDescription.new(
            t["function"]["name"],
            t["function"].get("description", ""),
            parameters=t["function"].get("parameters"),
        )  # fmt: skip
        for t in body.chat_tools() or ()
    ]
    if not body.instructions and not tools:
        return None
    developer = oh.DeveloperContent.new()
    if body.instructions:
        developer = developer.with_instructions(body.instructions)
    if tools and body.tool_choice != "none":
        developer = developer.with_function_tools(tools)
    return developer


def _message(oh: Any, item: dict[str, Any], names: dict[str, str], where: str) -> Any:
    kind = item.get("type", "message")
    if kind == "function_call":
        return (
            oh.Message.from_role_and_content(oh.Role.ASSISTANT, item["arguments"])
            .with_channel("commentary")
            .with_recipient(FUNCTIONS + item["name"])
            .with_content_type("<|constrain|>json")
        )
    if kind == "function_call_output":
        name = names.get(item["call_id"])
        if name is None:
            raise InvalidRequest(
                f"{where}: no function_call before it has call_id {item['call_id']!r}"
            )
        author = oh.Author.new(oh.Role.TOOL, FUNCTIONS + name)
        text = item_text(item.get("output"), where, "output")
        return (
            oh.Message.from_author_and_content(author, text)
            .with_channel("commentary")
            .with_recipient("assistant")
        )
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        text = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        return oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel("analysis")
    role = {"user": oh.Role.USER, "assistant": oh.Role.ASSISTANT}.get(
        item["role"], oh.Role.DEVELOPER
    )
    message = oh.Message.from_role_and_content(role, item_text(item.get("content", ""), where))
    return message.with_channel("final") if role == oh.Role.ASSISTANT else message


def stop_token_ids() -> list[int]:
    """Where an assistant turn ends: <|return|> and <|call|>."""
    return list(encoding().stop_tokens_for_assistant_actions())


class HarmonyOutputParser:
    """One output's ids -> chat-shaped deltas: the analysis channel is reasoning_content, a
    commentary message to functions.NAME a tool call, other text content. Output that is not
    valid Harmony (a model off format) is returned as content, decoded, never raised."""

    def __init__(self) -> None:
        import openai_harmony as oh

        self._enc = encoding()
        self._parser = oh.StreamableParser(self._enc, role=oh.Role.ASSISTANT)
        self._header_state = oh.StreamState.HEADER
        self._broken: list[int] | None = None  # ids after the format broke
        self._header: list[int] = []  # ids of the message header being read
        self._call_message = -1  # the parser's message index of the open tool call
        self.calls_made = 0

    def feed(self, ids: list[int]) -> dict[str, Any]:
        """The delta of these new output ids."""
        delta: dict[str, Any] = {"reasoning_content": "", "content": "", "tool_calls": []}
        for i, token in enumerate(ids):
            if self._broken is not None:
                self._broken.append(token)
                continue
            try:
                self._parser.process(token)
            except Exception:  # noqa: BLE001 - HarmonyError: the model left the format
                self._broken = self._header + list(ids[i:])
                continue
            in_header = self._parser.state == self._header_state
            self._header = self._header + [token] if in_header else []
            self._add(delta)
        return delta

    def finish(self) -> dict[str, Any]:
        """What the end settles: output after the format broke, or a header that never
        reached its message, as text."""
        rest = self._broken if self._broken is not None else self._header
        return {"content": self._enc.decode(rest) if rest else ""}

    def _add(self, delta: dict[str, Any]) -> None:
        piece = self._parser.last_content_delta or ""
        channel, recipient = self._parser.current_channel, self._parser.current_recipient
        if recipient is not None and recipient.startswith(FUNCTIONS):
            message = len(self._parser.messages)
            if message != self._call_message:  # a new call opens
                self._call_message = message
                name = recipient[len(FUNCTIONS) :]
                head = {"name": name, "arguments": ""}
                delta["tool_calls"].append(
                    {"index": self.calls_made, "id": new_call_id(), "function": head}
                )
                self.calls_made += 1
            if piece:
                args = {"arguments": piece}
                delta["tool_calls"].append({"index": self.calls_made - 1, "function": args})
        elif channel == "analysis":
            delta["reasoning_content"] += piece
        else:
            delta["content"] += piece
