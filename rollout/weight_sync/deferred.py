"""Deferred: a control call whose reply comes later, while the scheduler keeps stepping.

A call that waits on something outside the engine (joining a trainer's group: up to its whole
timeout) must not hold the step loop. Its method starts the waiting on a thread and returns a
Deferred; the scheduler loop polls `done()` between steps and, once it is true, runs `finish()`
on the scheduler's own thread, so the controller's state is only ever touched there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Deferred:
    """done: never blocks. finish: the call's reply, or another Deferred to wait on."""

    done: Callable[[], bool]
    finish: Callable[[], Any]


def in_thread(fn: Callable[[], T], name: str) -> Future[T]:
    """Runs `fn` on a daemon thread (the process may exit while it waits on a dead peer); its
    result or exception lands in the returned future."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - the waiting caller reports it
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
