"""Calls into an event loop that runs on a thread of its own (RolloutEngine's, RolloutPool's):
blocking ones from any other thread, awaited ones from any loop, that loop included.

A server may run on that loop itself (`rollout serve`, `rollout router`): its requests then
reach the engine or the pool with no hop between threads. A blocking call made there would
wait for the loop it holds, forever: it is refused with an error that says so.
"""

from __future__ import annotations

import asyncio
from typing import Any


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether the caller runs on `loop`."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def refuse_on_loop(loop: asyncio.AbstractEventLoop, owner: str) -> None:
    """Raises RuntimeError where a blocking call of `owner` would wait on its own loop."""
    if on_loop(loop):
        raise RuntimeError(
            f"a blocking {owner} method was called on the {owner}'s own event loop, where it "
            "would wait forever: await its async_ variant, or call it from a thread"
        )


def call_on(loop: asyncio.AbstractEventLoop, coro: Any, owner: str) -> Any:
    """`coro` run on `loop`, waited for on the caller's thread (not `loop`'s)."""
    if on_loop(loop):
        coro.close()
        refuse_on_loop(loop, owner)
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


async def await_on(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    """`coro` run on `loop`, awaited from the caller's loop: directly when that is `loop`."""
    if on_loop(loop):
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
