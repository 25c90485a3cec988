"""Streaming several samples of one call (a batch, or n > 1) as SGLang does: every sample's
stream runs at once, and their outputs come as they are made, each with its `index` in the list
the unstreamed call would return."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from rollout.engine.messages import TokenizedRequest

_DONE = object()


async def merge(tm: Any, inputs: list[TokenizedRequest]) -> AsyncIterator[dict]:
    """Runs on the engine's loop. `tm`: the TokenizerManager; `inputs`: the call's samples, in
    answer order, each with stream set. The first error of any sample is raised; closing the
    iterator early (or an error) aborts the samples still running."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, inp: TokenizedRequest) -> None:
        try:
            async for out in tm.generate(inp):
                queue.put_nowait((i, {**out, "index": i}))
        except Exception as e:  # noqa: BLE001 - raised to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, inp)) for i, inp in enumerate(inputs)]
    try:
        remaining = len(tasks)
        while remaining:
            _, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
