"""Streams from the engine's event loop, which runs on a thread of its own, to the caller: to a
plain thread (`to_thread`) or to the caller's own event loop (`to_loop`).

Either way the source runs on the engine's loop; when the consumer stops early the source is
cancelled (for a request: aborted), and the source's error is raised to the consumer. The
source is read as fast as the consumer reads, one output at a time: a request's updates made
while the consumer is busy wait at the source, which gives them as one output
(TokenizerManager.generate), instead of piling up here each repeating everything before it.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from typing import Any

_END = object()

Source = Callable[[], AsyncIterator[dict]]


class _Pump:
    """Runs on the engine's loop: puts the source's next output once the consumer asked."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, source: Source, put: Callable[[Any], Any]
    ) -> None:
        self.loop, self.source, self.put = loop, source, put
        self.asked = asyncio.Event()  # bound to the engine's loop at its first wait there

    async def run(self) -> None:
        try:
            async for out in self.source():
                self.put(out)
                await self.asked.wait()
                self.asked.clear()
        finally:
            self.put(_END)

    def ask(self) -> None:
        """From the consumer's thread or loop: it wants the next output."""
        try:
            self.loop.call_soon_threadsafe(self.asked.set)
        except RuntimeError:  # the engine's loop is closed: the pump is gone with it
            pass


def to_thread(loop: asyncio.AbstractEventLoop, source: Source) -> Iterator[dict]:
    q: queue.Queue = queue.Queue()
    pump = _Pump(loop, source, q.put)
    fut = asyncio.run_coroutine_threadsafe(pump.run(), loop)
    return _drain(q, fut, pump)


def _drain(q: queue.Queue, fut: Future, pump: _Pump) -> Iterator[dict]:
    try:
        while (item := q.get()) is not _END:
            yield item
            pump.ask()
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

    pump = _Pump(loop, source, put)
    fut = asyncio.run_coroutine_threadsafe(pump.run(), loop)
    try:
        while (item := await q.get()) is not _END:
            yield item
            pump.ask()
        await asyncio.wrap_future(fut)
    finally:
        fut.cancel()
