"""Server-sent events and client-disconnect handling shared by the native and OpenAI routes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from rollout.engine.indexed_streams import merge_streams
from rollout.server.json_render import render_in_pieces
from rollout.server.responses import describe_failure, is_large

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; its requests were aborted."""


def sse(data: Any) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, allow_nan=True)
    return f"data: {text}\n\n"


async def sse_event(data: Any) -> str | bytes:
    """sse(data). For large data (SGLang's native stream repeats every logprob so far in each
    event) it runs on a worker thread, the JSON made in pieces (see json_render), so that one
    event doesn't hold the event loop."""
    if not is_large(data):
        return sse(data)
    return await asyncio.to_thread(_large_sse, data)


def _large_sse(data: Any) -> bytes:
    return b"data: " + render_in_pieces(data) + b"\n\n"


async def first_item(items: AsyncIterator[T]) -> tuple[T, AsyncIterator[T]]:
    """Awaits the first item, so errors found before any output become a plain 4xx response
    instead of an error inside a 200 stream. Returns it with the iterator to continue from."""
    first = await items.__anext__()
    return first, items


def sse_response(
    events: AsyncIterator[str | bytes], request: Request | None = None
) -> StreamingResponse:
    """Streams `events` (already `sse()`-encoded). When the client goes away Starlette cancels the
    iteration; the engine's stream then aborts its request and frees its KV. With `request`, a
    stream left unfinished counts as a client disconnect in /metrics."""
    if request is not None:
        events = _count_disconnect(events, request)
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


async def _count_disconnect(
    events: AsyncIterator[str | bytes], request: Request
) -> AsyncIterator[str | bytes]:
    finished = False
    try:
        async for event in events:
            yield event
        finished = True
    finally:
        if not finished:
            request.app.state.metrics.disconnected(request.scope["path"])


def error_event(exc: BaseException, request: Request | None = None) -> str:
    """The SSE event for a stream that failed after its 200 (no tracebacks or paths: see
    describe_failure); with `request`, counted as an error in /metrics."""
    path = request.scope["path"] if request is not None else "stream"
    status, message, kind = describe_failure(exc, path)
    if request is not None:
        request.app.state.metrics.error(path, status, kind)
    return sse({"error": {"message": message, "type": kind, "code": status}})


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client disconnects first, cancels it (which aborts its requests) and
    raises ClientDisconnected once the cancellation has run."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # NOTE: a cancelled task is done only after it ran its cancellation (the abort);
            # asking for its result before that is an InvalidStateError.
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected("the client disconnected before its answer was ready")
    return task.result()


async def gather_streams(
    streams: list[AsyncIterator[dict]], on_item: Callable[[int, dict], list[str]]
) -> AsyncIterator[str]:
    """Merges several streams (the n choices of one OpenAI request) as they produce items;
    `on_item(choice_index, item)` turns each item into SSE events. Cancelling stops them all."""
    async for i, item in merge_streams(streams):
        for event in on_item(i, item):
            yield event
