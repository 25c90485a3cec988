"""Calls on a thread pool that let go of their arguments as they end.

A ThreadPoolExecutor's work item holds its callable and arguments until the worker thread is
back in its loop, which can be after the caller has its result or error. A request body held
there a moment too long is skipped by json_release (a container is only emptied when nothing
else holds it) and freed in one piece on that thread instead, holding the GIL throughout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any


class _Call:
    """fn(*args, **kwargs), once; holding none of them once it has returned or raised."""

    __slots__ = ("parts",)

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.parts: tuple | None = (fn, args, kwargs)

    def __call__(self) -> Any:
        assert self.parts is not None, "a worker call runs once"
        fn, args, kwargs = self.parts
        self.parts = None
        try:
            return fn(*args, **kwargs)
        finally:
            del fn, args, kwargs  # an error's traceback keeps this frame


async def run_in(executor: Executor, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Awaits fn(*args, **kwargs) on executor's threads; the executor's work item does not
    hold the arguments once the result (or the error) is set."""
    return await asyncio.wrap_future(executor.submit(_Call(fn, args, kwargs)))
