"""Streams from the engine's event loop, which runs on a thread of its own, to the caller: to a
plain thread (`to_thread`) or to the caller's own event loop (`to_loop`).

Either way the source runs on the engine's loop; when the consumer stops early the source is
cancelled (for a request: aborted), and the source's error is raised to the consumer.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

_END = object()

Source = Callable[[], AsyncIterator[dict]]


def to_thread(loop: asyncio.AbstractEventLoop, source: Source) -> Iterator[dict]:
    q: queue.Queue = queue.Queue()
    fut = asyncio.run_coroutine_threadsafe(_pump(source, q.put), loop)
    return _drain(q, fut)


def _drain(q: queue.Queue, fut: Future) -> Iterator[dict]:
    try:
        while (item := q.get()) is not _END:
            yield item
        fut.result()  # re-raises the source's error, if any
    finally:
        fut.cancel()  # the consumer stopped early: abort the request


async def to_loop(loop: asyncio.AbstractEventLoop, source: Source) -> AsyncIterator[dict]:
    caller = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()

    def put(item: Any) -> None:
        try:
            caller.call_soon_threadsafe(q.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: the consumer left, nothing to tell
            pass

    fut = asyncio.run_coroutine_threadsafe(_pump(source, put), loop)
    try:
        while (item := await q.get()) is not _END:
            yield item
        await asyncio.wrap_future(fut)
    finally:
        fut.cancel()


async def _pump(source: Source, put: Callable[[Any], Any]) -> None:
    try:
        async for out in source():
            put(out)
    finally:
        put(_END)
