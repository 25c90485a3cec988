"""`rollout router`'s connections: a one-prompt /generate answered whole is read, relayed and
answered on the connection itself; anything else hands the connection to uvicorn's protocol.

Through uvicorn and ASGI (generate_relay.py's GenerateRelay behind Guard and CountErrors), a
relayed request costs the router about as much host time as every other step of its relay
together: the request's scope, its cycle and task, the middlewares' wrappers of receive and
send (RESULTS.md, issue 21). A RelayConnection is the asyncio protocol uvicorn makes for each
connection (`uvicorn.Config(http=...)`). It reads a request whose head is the plain case
(`POST /generate HTTP/1.1`, a Content-Length within the body limits, no chunked body, no
Expect, no Upgrade), from a caller whose key is good, while the server is not shutting down,
with a body that relay_part relays and that does not stream; it sends the body to a worker
(Dispatcher.relay) and writes the worker's answer back, or the refusal the app would give,
counting both as the app's /generate does. Any other request, from its first byte, goes to
a new uvicorn HttpToolsProtocol, which serves the app for the rest of the connection (the
way uvicorn hands a connection to its WebSocket protocol): the app's checks and errors
answer it, so nothing the fast path skips changes what a client gets.

A client that leaves cancels its relay: the worker's connection closes and the worker aborts
the request. uvicorn's shutdown and keep-alive apply: the connection is in the server's set
and its relay in the server's tasks.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rollout.pool.dispatch import Dispatcher
from rollout.pool.generate_relay import PATH, REPLICA_HEADER, observe_answer
from rollout.pool.requests import Part, relay_part
from rollout.server.guard import bearer_token, caller_role
from rollout.server.json_body import LARGE_BODY_BYTES
from rollout.server.options import ServerOptions
from rollout.server.responses import describe_failure, error

REQUEST_LINE = b"POST " + PATH.encode() + b" HTTP/1.1"
HEAD_END = b"\r\n\r\n"
MAX_HEAD_BYTES = 16384  # a longer head goes to uvicorn, which applies its own limits
HIGH_WATER_BYTES = 2**16  # bytes of the next requests read while one is relayed
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n".encode() for s in HTTPStatus}


@dataclass(frozen=True)
class RelaySetup:
    """What a connection's relay needs of the router: its dispatcher, its app's state
    (metrics, the rids' owners, `stopping`) and options (keys, the body limit)."""

    dispatcher: Dispatcher
    state: Any
    options: ServerOptions

    def protocol(self) -> Any:
        """The `http` argument of uvicorn.Config: makes a RelayConnection per connection."""
        return functools.partial(RelayConnection, self)


@dataclass(frozen=True)
class _Head:
    raw: bytes  # as it came, its blank line included
    length: int  # the body's bytes
    role: str | None  # the caller's, by its Authorization header's key (guard.caller_role)
    keep_alive: bool

    @staticmethod
    def parse(head: bytes, options: ServerOptions) -> _Head | None:
        """The head (its blank line included) of a request the fast path may take, or None."""
        lines = head[: -len(HEAD_END)].split(b"\r\n")
        if lines[0] != REQUEST_LINE:
            return None
        length, token, keep_alive, seen_auth = None, None, True, False
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not name or name[:1] in b" \t" or name[-1:] in b" \t":
                return None  # malformed: uvicorn's parser answers it
            name, value = name.lower(), value.strip()
            if name == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
            elif name in (b"transfer-encoding", b"expect", b"upgrade"):
                return None
            elif name == b"connection":
                connection = {option.strip().lower() for option in value.split(b",")}
                if b"upgrade" in connection:
                    return None
                keep_alive = keep_alive and b"close" not in connection
            elif name == b"authorization" and not seen_auth:  # the first, as the Guard reads
                seen_auth, token = True, bearer_token(value)
        if length is None:
            return None
        return _Head(head, length, caller_role(options, token), keep_alive)


class RelayConnection(asyncio.Protocol):
    def __init__(
        self, setup: RelaySetup, config: Any, server_state: Any, app_state: dict,
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:  # fmt: skip
        """uvicorn's protocol arguments (server.py's create_protocol), after the router's."""
        self.setup = setup
        self.limit = min(LARGE_BODY_BYTES, setup.options.max_request_bytes)
        self.uvicorn_args = {"config": config, "server_state": server_state, "app_state": app_state}
        self.server_state = server_state
        self.keep_alive_s = config.timeout_keep_alive
        self.loop = _loop or asyncio.get_event_loop()
        self.access_logger = logging.getLogger("uvicorn.access")
        self.access_log = self.access_logger.hasHandlers()
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.buffer = bytearray()
        self.head: _Head | None = None  # read, its body still coming
        self.relaying: asyncio.Task | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.paused = False
        self.closing = False  # close once the answer in flight is out (a shutdown)
        self.lost = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else ""
        self.server_state.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self._cancel_idle_timer()
        self.buffer += data
        if self.relaying is None:
            self._next()
        elif len(self.buffer) > HIGH_WATER_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self) -> None:
        pass  # the transport closes; a relay in flight is cancelled in connection_lost

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server_state.connections.discard(self)
        self._cancel_idle_timer()
        if self.relaying is not None:
            self.relaying.cancel()

    # uvicorn's server
    def shutdown(self) -> None:
        """Called by the server at shutdown: close now if idle, else after the answer."""
        if self.relaying is None:
            self.transport.close()
        else:
            self.closing = True

    # the requests
    def _next(self) -> None:
        """Starts relaying the request at the buffer's start once it is whole, or hands the
        connection to uvicorn if the fast path does not take it."""
        if self.head is None:
            end = self.buffer.find(HEAD_END, 0, MAX_HEAD_BYTES + len(HEAD_END))
            if end < 0:
                if len(self.buffer) > MAX_HEAD_BYTES:
                    self._hand_over()
                return  # the head is still coming
            head = _Head.parse(bytes(self.buffer[: end + len(HEAD_END)]), self.setup.options)
            if head is None or not self._admitted(head):
                self._hand_over()
                return
            del self.buffer[: end + len(HEAD_END)]
            self.head = head
        if len(self.buffer) < self.head.length:
            return  # the body is still coming
        head, self.head = self.head, None
        body = bytes(self.buffer[: head.length])
        taken = _taken(body)
        if taken is None:
            self.buffer[:0] = head.raw  # uvicorn reads the request from its first byte
            self._hand_over()
            return
        del self.buffer[: head.length]
        fields, part = taken
        self.relaying = task = self.loop.create_task(self._relay(fields, part, head))
        self.server_state.tasks.add(task)
        task.add_done_callback(self.server_state.tasks.discard)

    def _admitted(self, head: _Head) -> bool:
        """Whether the Guard would let it through without a word (else the Guard answers)."""
        return (
            head.length <= self.limit
            and not getattr(self.setup.state, "stopping", False)
            and head.role is not None
        )

    async def _relay(self, fields: dict, part: Part, head: _Head) -> None:
        setup, start = self.setup, time.monotonic()
        try:
            with setup.state.owners.claim(fields.get("rid"), head.role):
                answer, replica = await setup.dispatcher.relay(part)
        except asyncio.CancelledError:
            if not self.lost:
                raise  # the server's shutdown cancelled it
            setup.state.metrics.disconnected(PATH)
            return
        except Exception as e:  # noqa: BLE001 - answered as the app's handlers answer it
            status, message, kind = describe_failure(e, PATH)
            setup.state.metrics.error(PATH, status, kind)
            self._answer(status, error(status, message, kind).body, b"", head)
        else:  # counted before the client can read the answer (a scrape after it sees it)
            if fields.get("log_metrics", True):
                observe_answer(setup.state.metrics, answer, start)
            self._answer(200, answer, REPLICA_HEADER + b": %d\r\n" % replica, head)
        finally:
            self.relaying = None
        self._after_answer(head)

    def _answer(self, status: int, body: bytes, extra: bytes, head: _Head) -> None:
        if self.lost:
            return
        keep_alive = head.keep_alive and not self.closing
        lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        lines += [
            name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers
        ]
        lines += [b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body), extra]
        if not keep_alive:
            lines.append(b"connection: close\r\n")
        lines += [b"\r\n", body]
        self.transport.write(b"".join(lines))
        if self.access_log:
            self.access_logger.info('%s - "POST %s HTTP/1.1" %d', self.client, PATH, status)

    def _after_answer(self, head: _Head) -> None:
        self.server_state.total_requests += 1
        if self.lost:
            return
        if not head.keep_alive or self.closing:
            self.transport.close()
            return
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if self.buffer:
            self._next()  # a request sent before this answer (pipelined)
        else:
            self.idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_timeout)

    def _idle_timeout(self) -> None:
        self.idle_timer = None
        if self.relaying is None and not self.buffer:
            self.transport.close()

    def _cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _hand_over(self) -> None:
        """The connection goes to uvicorn's protocol, which reads the buffer first."""
        self._cancel_idle_timer()
        self.server_state.connections.discard(self)
        protocol = HttpToolsProtocol(**self.uvicorn_args, _loop=self.loop)
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        if self.paused:
            self.paused = False
            self.transport.resume_reading()
        if self.buffer:
            data, self.buffer = bytes(self.buffer), bytearray()
            protocol.data_received(data)


def _taken(body: bytes) -> tuple[dict, Part] | None:
    """The body's fields and part if the fast path relays it: one prompt (relay_part), not a
    stream (streams keep GenerateRelay's path), else None (for uvicorn and the app)."""
    try:
        fields = json.loads(body)
        part = relay_part(fields, body)
    except (ValueError, RecursionError, TypeError):  # the app answers it
        return None
    if part is None or fields.get("stream", False):
        return None
    return fields, part
