"""Dispatcher: sends each part of a call to the replica the router picks, and retries a part
whose replica died on another one, once.

A retried answer carries meta_info["retried"] = True. A part whose retry fails too, or a stream
that had already sent outputs when its replica died (its consumer has seen tokens that a
fresh start would not repeat), fails with EngineDeadError naming what happened. When no
replica serves, a part waits up to `wait_s` for one to come back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from rollout.engine.tokenizer_manager import EngineDeadError
from rollout.errors import InvalidRequest
from rollout.generate_request import GenerateRequest
from rollout.pool.replica import Replica, ReplicaDead
from rollout.pool.requests import (
    Part,
    events_retried,
    join,
    json_retried,
    mark_retried,
    session_pin,
    split,
)
from rollout.pool.router import Route, Router
from rollout.pool.supervisor import Supervisor

T = TypeVar("T")


class Dispatcher:
    def __init__(self, supervisor: Supervisor, router: Router, wait_s: float) -> None:
        self.supervisor = supervisor
        self.router = router
        self.wait_s = wait_s
        self._opening: set[str] = set()  # session ids whose open_session is under way

    async def generate(self, request: GenerateRequest) -> Any:
        parts, joined = split(request)
        if not joined:
            return await self._generate(parts[0])
        tasks = [asyncio.ensure_future(self._generate(p)) for p in parts]
        try:
            return join(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()  # the others are aborted on their replicas
            raise

    async def _generate(self, part: Part) -> Any:
        answer, retried, _ = await self._run(part, lambda replica: replica.generate(part.request))
        return mark_retried(answer) if retried else answer

    def stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        [part], _ = split(request)
        return self._stream(part, lambda replica: replica.stream(part.request), mark_retried)

    async def relay(self, part: Part) -> tuple[bytes, int]:
        """A worker's JSON answer to a part whose request is a client's body (relay_part), as
        the worker gave it (HttpReplica.relay), made again with meta_info["retried"] when a
        second worker gave it; and the index of the replica that gave it."""
        answer, retried, replica = await self._run(part, lambda r: r.relay(part.request))
        return (json_retried(answer) if retried else answer), replica

    def relay_stream(self, part: Part) -> AsyncIterator[bytes]:
        """A worker's server-sent events for such a part, as relay does the answer."""
        return self._stream(
            part, lambda replica: replica.relay_stream(part.request), events_retried
        )

    async def _run(
        self, part: Part, send: Callable[[Replica], Awaitable[T]]
    ) -> tuple[T, bool, int]:
        """`send(replica)`'s answer from the replica the part is routed to, whether it was
        retried (its first replica died), and the index of the replica that answered."""
        failed: int | None = None
        while True:
            route = await self._route(part, avoid=failed)
            self.router.started(route.replica, part.tokens)
            try:
                answer = await send(self.supervisor.replicas[route.replica])
            except ReplicaDead as e:
                self.supervisor.mark_dead(route.replica, str(e))
                if failed is not None:
                    raise EngineDeadError(_lost(e, False, True)) from None
                self.router.count(route.replica, "retried_elsewhere")
                failed = route.replica
                continue
            finally:
                self.router.finished(route.replica, part.tokens)
            return answer, failed is not None, route.replica

    async def _stream(
        self, part: Part, open_stream: Callable[[Replica], AsyncIterator[T]],
        mark: Callable[[T], T],
    ) -> AsyncIterator[T]:  # fmt: skip
        """`open_stream(replica)`'s items, from the replica the part is routed to; `mark`ed
        once a second replica sends them."""
        failed: int | None = None
        while True:
            route = await self._route(part, avoid=failed)
            replica = self.supervisor.replicas[route.replica]
            sent = False
            self.router.started(route.replica, part.tokens)
            try:
                async for out in open_stream(replica):
                    sent = True
                    yield mark(out) if failed is not None else out
                return
            except ReplicaDead as e:
                self.supervisor.mark_dead(route.replica, str(e))
                if sent or failed is not None:
                    raise EngineDeadError(_lost(e, sent, failed is not None)) from None
                failed = route.replica
            finally:
                self.router.finished(route.replica, part.tokens)

    async def call_one(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """An engine method on one replica, the least loaded (encode, classify, score, reads
        of the weights): retried once elsewhere if that replica dies."""
        failed: int | None = None
        while True:
            serving = await self.supervisor.wait_serving(self.wait_s)
            choice = [i for i in serving if i != failed] or serving
            i = min(choice, key=lambda j: self.router.counters[j].load_tokens)
            try:
                return await self.supervisor.replicas[i].call(method, *args, **kwargs)
            except ReplicaDead as e:
                self.supervisor.mark_dead(i, str(e))
                if failed is not None:
                    raise EngineDeadError(_lost(e, False, True)) from None
                failed = i

    async def open_session(self, capacity_of_str_len: int, session_id: str | None) -> str:
        """Opens a session on the least loaded replica; its turns all go there (their KV)."""
        if session_id is not None and (
            session_id in self._opening
            or self.router.pinned_replica(session_pin(session_id)) is not None
        ):
            # Another replica would open it again, and the pool forget the first one.
            raise InvalidRequest(f"session {session_id!r} is already open")
        if session_id is not None:
            self._opening.add(session_id)
        try:
            serving = await self.supervisor.wait_serving(self.wait_s)
            i = min(serving, key=lambda j: self.router.counters[j].load_tokens)
            opened = await self.supervisor.replicas[i].call(
                "open_session", capacity_of_str_len, session_id
            )
            self.router.pin(session_pin(opened), i)
            return opened
        finally:
            self._opening.discard(session_id)

    async def close_session(self, session_id: str) -> None:
        """Closes the session on its replica (InvalidRequest there, or here for an id this
        pool never opened)."""
        i = self.router.pinned_replica(session_pin(session_id))
        if i is None:
            raise InvalidRequest(f"no open session {session_id!r} on this pool")
        try:
            await self.supervisor.replicas[i].call("close_session", session_id)
        finally:
            self.router.unpin(session_pin(session_id))

    async def _route(self, part: Part, avoid: int | None) -> Route:
        serving = await self.supervisor.wait_serving(self.wait_s)
        others = [i for i in serving if i != avoid]
        return self.router.route(part.key, others or serving, part.rid)

    async def abort(self, rid: str | None, abort_all: bool) -> None:
        """abort_request: to the replica the rid went to, or to every serving one."""
        pinned = None if abort_all or rid is None else self.router.pinned_replica(rid)
        serving = self.supervisor.serving()
        targets = [pinned] if pinned in serving else serving
        results = await asyncio.gather(
            *(self.supervisor.replicas[i].call("abort_request", rid, abort_all) for i in targets),
            return_exceptions=True,
        )
        for i, result in zip(targets, results):
            if isinstance(result, ReplicaDead):
                self.supervisor.mark_dead(i, str(result))
            elif isinstance(result, BaseException):
                raise result


def _lost(error: Exception, sent: bool, retried: bool) -> str:
    if sent:
        return f"{error} while streaming this request (outputs were already sent; not retried)"
    return f"{error}; this request had already been retried once after another replica died"
