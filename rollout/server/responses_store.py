"""Stored responses of /v1/responses (store=true), in memory and bounded: what
previous_response_id continues from and GET /v1/responses/{id} returns."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from rollout.errors import InvalidRequest

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * 2**20  # of the items' JSON, over all stored responses


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as it was returned
    conversation: list[dict[str, Any]]  # every input item so far, then this response's output
    # What this response adds to the store: the JSON length of its new items and itself (the
    # items it shares with the response it continues are that one's).
    size: int = 0


class ResponseStore:
    """The newest stored responses, at most `capacity` of them and `max_chars` of their items
    in all; older ones are forgotten (a continuation of a forgotten one is a 400 that says
    so). The newest one is always kept. Safe to use from several threads."""

    def __init__(
        self, capacity: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity, self.max_chars = capacity, max_chars
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> None:
        with self._lock:
            old = self._items.pop(stored.response["id"], None)
            self._chars -= old.size if old is not None else 0
            self._items[stored.response["id"]] = stored
            self._chars += stored.size
            while len(self._items) > 1 and (
                len(self._items) > self.capacity or self._chars > self.max_chars
            ):
                self._chars -= self._items.popitem(last=False)[1].size

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            old = self._items.pop(response_id, None)
            self._chars -= old.size if old is not None else 0
            return old is not None

    def conversation(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """The items a continuation of `previous_response_id` starts from (none without one)."""
        if previous_response_id is None:
            return []
        stored = self.get(previous_response_id)
        if stored is None:
            raise InvalidRequest(
                f"previous_response_id {previous_response_id!r} is not a stored response of this "
                f"server (responses are kept with store=true, the newest {self.capacity} or "
                f"{self.max_chars} characters of them, until the server restarts)"
            )
        return list(stored.conversation)


def app_store(state: Any) -> ResponseStore:
    """The app's store of responses (`request.app.state`'s, made on first use)."""
    if getattr(state, "responses", None) is None:
        state.responses = ResponseStore()
    return state.responses


def stored(
    response: dict[str, Any], conversation: list[dict[str, Any]], request_input: Any
) -> StoredResponse:
    """A response to store; `conversation` ends with its output, `request_input` is what its
    request added (the items before are the continued response's)."""
    size = len(json.dumps(request_input, ensure_ascii=False)) + len(json.dumps(response))
    return StoredResponse(response, conversation, size)
