"""The event stream of a streamed /v1/responses answer: response.created, the output items'
events (response.output_text.delta, response.function_call_arguments.delta, ...), then
response.completed (response.incomplete at max_output_tokens or an abort; an error event and
response.failed when it fails), each numbered; the finished response is stored as the whole
one would be."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from rollout.server.responses_output import (
    OutputBuilder,
    feed_chat,
    final_status,
    response_object,
    responses_usage,
    stored_items,
)
from rollout.server.responses_protocol import ResponsesRequest
from rollout.server.responses_store import ResponseStore, stored
from rollout.server.streaming import sse_response


class EventStream:
    """One streamed response. `parts` (see run) are chat-shaped: {"delta": {...},
    "finish_reason"}, {"usage": chat usage}, or {"error": {"message", "type", "code"}}."""

    def __init__(
        self,
        rid: str,
        body: ResponsesRequest,
        conversation: list[dict[str, Any]],
        store: ResponseStore,
    ) -> None:
        self.rid, self.body, self.conversation, self.store = rid, body, conversation, store
        self.sequence = 0
        # One response, one created_at: in every event's Response object and the stored one.
        self.created = time.time()

    def response(self, parts: AsyncIterator[dict]) -> StreamingResponse:
        return sse_response(self.run(parts))

    async def run(self, parts: AsyncIterator[dict]) -> AsyncIterator[str]:
        builder = OutputBuilder()
        usage, reason = None, None
        start = self._response([], "in_progress")
        yield self._send({"type": "response.created", "response": start})
        yield self._send({"type": "response.in_progress", "response": start})
        try:
            async for part in parts:
                if "error" in part:
                    for event in self._failed(builder, part["error"]):
                        yield event
                    return
                if "usage" in part:
                    usage = part["usage"]
                    continue
                for event in feed_chat(builder, part["delta"]):
                    yield self._send(event)
                reason = part.get("finish_reason") or reason
        finally:
            await _close(parts)
        for event in builder.close():
            yield self._send(event)
        status, incomplete = final_status(reason)
        final = self._response(builder.items, status, responses_usage(usage), incomplete)
        if self.body.store:
            conversation = self.conversation + stored_items(builder.items)
            self.store.put(stored(final, conversation, self.body.input))
        yield self._send({"type": f"response.{status}", "response": final})

    def _failed(self, builder: OutputBuilder, err: dict[str, Any]) -> list[str]:
        failed = self._response(builder.items, "failed")
        failed["error"] = {"code": str(err.get("type", "server_error")), "message": err["message"]}
        error_event = {"type": "error", "code": failed["error"]["code"],
                       "message": err["message"], "param": None}  # fmt: skip
        return [
            self._send(error_event),
            self._send({"type": "response.failed", "response": failed}),
        ]

    def _response(
        self,
        items: list[dict[str, Any]],
        status: str,
        usage: dict[str, Any] | None = None,
        incomplete_reason: str | None = None,
    ) -> dict[str, Any]:
        return response_object(
            self.rid, self.body, items, status, usage, incomplete_reason, created=self.created
        )

    def _send(self, event: dict[str, Any]) -> str:
        event = {**event, "sequence_number": self.sequence}
        self.sequence += 1
        data = json.dumps(event, ensure_ascii=False)
        return f"event: {event['type']}\ndata: {data}\n\n"


async def _close(parts: AsyncIterator[dict]) -> None:
    close = getattr(parts, "aclose", None)
    if close is not None:
        await close()
