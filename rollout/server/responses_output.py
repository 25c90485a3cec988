"""The output items of a /v1/responses answer, built from what the model wrote (reasoning,
text, function calls) piece by piece, and the stream events that say so.

One OutputBuilder serves both answers: the streamed one sends the events each call returns;
the whole one feeds everything at once and keeps only `items`. Text, reasoning and calls are
items of their own; a change of kind closes the open item, as the OpenAI stream does.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from rollout.server.responses_protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    """Output items so far; every method returns the stream events (without sequence numbers)
    of what it added."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[Any, dict[str, Any]] = {}  # the parser's call key -> its item
        self._index: dict[str, int] = {}  # item id -> its output_index

    def reasoning(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = self._ensure("reasoning")
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        return events + [self._part_event("response.reasoning_text.delta", item, delta=delta)]

    def text(self, delta: str) -> list[dict]:
        if not delta:
            return []
        events = self._ensure("message")
        item = self._open
        assert item is not None
        item["content"][0]["text"] += delta
        event = self._part_event("response.output_text.delta", item, delta=delta, logprobs=[])
        return events + [event]

    def call(self, key: Any, call_id: str, name: str) -> list[dict]:
        """Opens function call `key` (the parser's index of the call)."""
        events = self.close()
        item = {
            "id": new_id("fc"), "type": "function_call", "status": "in_progress",
            "call_id": call_id, "name": name, "arguments": "",
        }  # fmt: skip
        self._calls[key] = item
        return events + self._add(item)

    def arguments(self, key: Any, delta: str) -> list[dict]:
        item = self._calls.get(key)
        if item is None or not delta:
            return []
        item["arguments"] += delta
        return [self._item_event("response.function_call_arguments.delta", item, delta=delta)]

    def close(self) -> list[dict]:
        """Closes the open item (if any): its done events."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events.append(
                self._part_event("response.output_text.done", item, text=part["text"], logprobs=[])
            )
            events.append(self._part_event("response.content_part.done", item, part=dict(part)))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            events.append(self._part_event("response.reasoning_text.done", item, text=part["text"]))
            events.append(self._part_event("response.content_part.done", item, part=dict(part)))
        else:
            events.append(
                self._item_event(
                    "response.function_call_arguments.done",
                    item,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        index = self._index[item["id"]]
        events.append(
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)}
        )
        return events

    def _ensure(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self.close()
        if kind == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"id": new_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": [part]}  # fmt: skip
        else:
            part = {"type": "reasoning_text", "text": ""}
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [],
                    "status": "in_progress", "content": [part]}  # fmt: skip
        events += self._add(item)
        added_part = dict(part)
        events.append(self._part_event("response.content_part.added", item, part=added_part))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict]:
        self._index[item["id"]] = len(self.items)
        self.items.append(item)
        self._open = item
        shown = _copy(item)
        if "content" in shown:
            shown["content"] = []
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": shown}]  # fmt: skip

    def _item_event(self, kind: str, item: dict, **fields: Any) -> dict:
        return {"type": kind, "item_id": item["id"], "output_index": self._index[item["id"]],
                **fields}  # fmt: skip

    def _part_event(self, kind: str, item: dict, **fields: Any) -> dict:
        return self._item_event(kind, item, content_index=0, **fields)


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p) for p in out["content"]]
    return out


def response_object(
    rid: str,
    body: ResponsesRequest,
    items: list[dict[str, Any]],
    status: str,
    usage: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    created: float | None = None,
) -> dict[str, Any]:
    """The Response object (status in_progress, completed or incomplete). `created` (a
    time.time(); now if None) is the response's created_at: a stream passes the same one to
    each of its objects."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(created if created is not None else time.time()),
        "status": status,
        "model": body.model,
        "output": [_copy(item) for item in items],
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "tools": body.tools or [],
        "tool_choice": body.tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_output_tokens": body.max_output_tokens,
        "store": body.store,
        "text": body.text or {"format": {"type": "text"}},
        "reasoning": body.reasoning,
        "truncation": body.truncation or "disabled",
        "metadata": body.metadata or {},
        "user": body.user,
        "usage": usage,
        "error": None,
        "incomplete_details": (
            {"reason": incomplete_reason} if incomplete_reason is not None else None
        ),
    }


def final_status(finish_reason: str | None) -> tuple[str, str | None]:
    """The response's status and incomplete_details reason from the chat finish reason: the
    output limit or an abort (abort_request, a shutdown) leave it incomplete."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    if finish_reason == "abort":
        return "incomplete", "aborted"
    return "completed", None


def responses_usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat API's usage in the Responses API's names."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def stored_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items as the input items of a continuation."""
    return [_copy(item) for item in items]


def feed_chat(builder: OutputBuilder, delta: dict[str, Any]) -> list[dict]:
    """Adds a chat message or delta ({"reasoning_content", "content", "tool_calls"}) to
    `builder`; returns its events. A call's first piece has its id and name."""
    events = builder.reasoning(delta.get("reasoning_content") or "")
    events += builder.text(delta.get("content") or "")
    for i, call in enumerate(delta.get("tool_calls") or ()):
        key = call.get("index", i)
        function = call.get("function") or {}
        if call.get("id") is not None:
            events += builder.call(key, call["id"], function.get("name") or "")
        events += builder.arguments(key, function.get("arguments") or "")
    return events
