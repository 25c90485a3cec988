"""Server-sent events and client-disconnect handling shared by the native and OpenAI routes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, allow_nan=True)
    return f"data: {text}\n\n"


async def first_item(items: AsyncIterator[T]) -> tuple[T, AsyncIterator[T]]:
    """Awaits the first item, so errors found before any output become a plain 4xx response
    instead of an error inside a 200 stream. Returns it with the iterator to continue from."""
    first = await items.__anext__()
    return first, items


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    """Streams `events` (already `sse()`-encoded). When the client goes away Starlette cancels the
    iteration; the engine's stream then aborts its request and frees its KV."""
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def error_event(exc: BaseException) -> str:
    status = 400 if isinstance(exc, (ValueError, TypeError)) else 500
    return sse({"error": {"message": str(exc), "type": type(exc).__name__, "code": status}})


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client disconnects first, cancels it (aborting its requests)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise asyncio.CancelledError("the client disconnected")
    return task.result()


async def gather_streams(
    streams: list[AsyncIterator[dict]], on_item: Callable[[int, dict], list[str]]
) -> AsyncIterator[str]:
    """Merges several streams (the n choices of one OpenAI request) as they produce items;
    `on_item(choice_index, item)` turns each item into SSE events. Cancelling stops them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[dict]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                for event in on_item(i, item):
                    yield event
    finally:
        for t in tasks:
            t.cancel()
