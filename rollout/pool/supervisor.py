"""Supervisor: the pool's replicas and their states; noticing a death and bringing the replica
back with the pool's current weights before it takes traffic again.

States: starting -> serving; serving -> dead (a call found it gone, or a health check did) ->
restarting -> serving, or -> stale when its weights could not be brought up to date (it then
takes no traffic, until an update gives the pool a copy of every weight), or -> failed after
`max_restarts` failed starts in a row. Only `serving` replicas are routed to. Each start bumps
the replica's incarnation: an update group formed before it no longer holds it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from rollout.engine.tokenizer_manager import EngineDeadError
from rollout.pool.replica import Replica, ReplicaDead
from rollout.pool.router import Router

logger = logging.getLogger(__name__)

SERVING, STALE, DEAD, RESTARTING, FAILED, STARTING = (
    "serving", "stale", "dead", "restarting", "failed", "starting",
)  # fmt: skip
RETRY_BACKOFF_S = 1.0

Restore = Callable[[int], Awaitable[None]]


class StaleWeights(Exception):
    """The pool could not give a restarted replica its current weights."""


class Supervisor:
    def __init__(
        self, replicas: list[Replica], router: Router, health_check_s: float = 2.0,
        max_restarts: int = 3,
    ) -> None:  # fmt: skip
        self.replicas = replicas
        self.router = router
        self.health_check_s = health_check_s
        self.max_restarts = max_restarts
        self.state = [STARTING] * len(replicas)
        self.reason: list[str | None] = [None] * len(replicas)
        self.incarnation = [0] * len(replicas)
        self.restarts = [0] * len(replicas)
        self.restore: Restore | None = None  # set by the pool: pushes the current weights
        # Set when replica i is marked dead: the calls `call` made to that incarnation give up.
        self._down = [asyncio.Event() for _ in replicas]
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    async def start_all(self) -> list[dict]:
        """Starts every replica at once; on any failure stops them all and raises."""
        infos = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        failed = [(r, e) for r, e in zip(self.replicas, infos) if isinstance(e, BaseException)]
        if failed:
            await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)
            replica, error = failed[0]
            raise RuntimeError(f"{replica.name} failed to start: {error}") from error
        for i in range(len(self.replicas)):
            self._set(i, SERVING)
        if self.health_check_s > 0:
            self._spawn(self._health_loop())
        return list(infos)

    def serving(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == SERVING]

    def up(self) -> list[int]:
        """Replicas that run (serving, or stale: up with weights the pool could not restore)."""
        return [i for i, s in enumerate(self.state) if s in (SERVING, STALE)]

    def stale(self) -> list[int]:
        return [i for i, s in enumerate(self.state) if s == STALE]

    async def wait_serving(self, timeout: float) -> list[int]:
        """The serving replicas, waiting up to `timeout` s for one while none is."""
        deadline = time.monotonic() + timeout
        while not (serving := self.serving()):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed or all(s == FAILED for s in self.state):
                raise EngineDeadError(f"no replica of the pool is serving ({self.describe()})")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        return serving

    def mark_dead(self, i: int, reason: str) -> None:
        """Replica i is gone (or must be started afresh): route nothing more to it, restart
        it. Idempotent while it is down."""
        if self._closed or self.state[i] in (DEAD, RESTARTING, FAILED):
            return
        logger.warning(
            "rollout pool: %s is down (%s); restarting it", self.replicas[i].name, reason
        )
        self.reason[i] = reason
        self._set(i, DEAD)
        self._down[i].set()
        self._down[i] = asyncio.Event()  # for the calls of its next incarnation
        self.router.forget(i)
        self.router.count(i, "deaths")
        self._spawn(self._recover(i))

    async def call(self, i: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Replica i's `method`, given up with ReplicaDead if the replica is marked dead
        meanwhile (a health check found it hung): a pool-wide call waits for a hung replica
        no longer than the check that finds it."""
        down = self._down[i]
        call = asyncio.ensure_future(self.replicas[i].call(method, *args, **kwargs))
        watch = asyncio.ensure_future(down.wait())
        try:
            done, _ = await asyncio.wait((call, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not call.done():
                call.cancel()
        if call not in done:
            raise ReplicaDead(
                f"{self.replicas[i].name} went down during {method}: {self.reason[i]}"
            )
        return call.result()

    async def _recover(self, i: int) -> None:
        replica = self.replicas[i]
        failures = 0
        while not self._closed:
            self._set(i, RESTARTING)
            try:
                if replica.restartable:
                    await replica.start()
                elif not await replica.alive():
                    raise RuntimeError("not reachable yet")
                self.incarnation[i] += 1
                self.restarts[i] += 1
                self.router.count(i, "restarts")
                if self.restore is not None:
                    await self.restore(i)
                self.reason[i] = None
                self._set(i, SERVING)
                return
            except StaleWeights as e:
                self.reason[i] = str(e)
                self._set(i, STALE)
                logger.warning("rollout pool: %s is up with stale weights: %s", replica.name, e)
                return
            except Exception as e:  # noqa: BLE001 - a failed start: try again, then give up
                failures += 1
                self.reason[i] = f"restart failed: {e}"
                if replica.restartable and failures > self.max_restarts:
                    logger.error("rollout pool: %s failed to restart: %s", replica.name, e)
                    self._set(i, FAILED)
                    return
                # A worker that the pool cannot start is polled until its supervisor has.
                backoff = min(failures, 10) if replica.restartable else 1
                await asyncio.sleep(RETRY_BACKOFF_S * backoff)

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_check_s)
            for i in self.up():
                if not await self.replicas[i].alive():
                    self.mark_dead(i, "it failed a health check")

    def set_serving(self, i: int) -> None:
        """A stale replica has the pool's weights now: it serves again."""
        if self.state[i] == STALE:
            self.reason[i] = None
            self._set(i, SERVING)

    def describe(self) -> str:
        return ", ".join(
            f"{r.name}: {s}" + (f" ({self.reason[i]})" if self.reason[i] else "")
            for i, (r, s) in enumerate(zip(self.replicas, self.state))
        )

    def info(self) -> list[dict]:
        return [
            {"replica": i, "name": r.name, "state": s, "reason": self.reason[i],
             "restarts": self.restarts[i], "ranks": r.ranks}
            for i, (r, s) in enumerate(zip(self.replicas, self.state))
        ]  # fmt: skip

    async def stop(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*(r.stop() for r in self.replicas), return_exceptions=True)

    def _set(self, i: int, state: str) -> None:
        self.state[i] = state
        self._changed.set()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
