"""Streaming several samples of one call (a batch, or n > 1) as SGLang does: every sample's
stream runs at once, and their outputs come as they are made, each with its `index` in the list
the unstreamed call would return."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from rollout.engine.messages import TokenizedRequest

_DONE = object()


async def merge_streams(streams: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(i, item) from every stream as they come, all streams running at once; the first error
    of any is raised, and closing the iterator early (or an error) cancels the others."""
    # Bounded: a stream is read only as fast as the consumer takes its items, so that a slow
    # consumer gets each stream's later updates merged (TokenizerManager.generate).
    queue: asyncio.Queue = asyncio.Queue(maxsize=max(len(streams), 1))

    async def pump(i: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, _DONE))
        except asyncio.CancelledError:  # the consumer left: nobody takes from the queue
            raise
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merge(tm: Any, inputs: list[TokenizedRequest]) -> AsyncIterator[dict]:
    """Runs on the engine's loop. `tm`: the TokenizerManager; `inputs`: the call's samples, in
    answer order, each with stream set. The first error of any sample is raised; closing the
    iterator early (or an error) aborts the samples still running."""
    async for i, out in merge_streams([tm.generate(inp) for inp in inputs]):
        yield {**out, "index": i}
