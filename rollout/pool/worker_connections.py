"""Kept HTTP/1.1 connections from `rollout router` to one worker, for requests whose answer comes
whole (a /generate that does not stream).

A relayed request is one small POST and one JSON answer; aiohttp's client spends most of what
the router adds to such a request on its own machinery (its request and response objects,
timers, tracing hooks). Here a request is the bytes of its head and body written to a kept
connection, and the answer is read by httptools' parser (uvicorn's, already installed) into
one bytes object: nothing else per request. Streams and control calls keep aiohttp and
RolloutClient (http_replica.py).

A connection carries one request at a time; idle ones are kept for KEEPALIVE_S (less than the
worker's own keep-alive, so that a request never goes out on a connection the worker is
closing). A request cancelled before its answer closes its connection: the worker sees its
client leave and aborts the request, as it would for any client.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from urllib.parse import urlsplit

import httptools

KEEPALIVE_S = 4.0


class WorkerGone(ConnectionError):
    """The connection closed (or could not open) before the whole answer came."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future | None = None
        self.body: list[bytes] = []
        self.keep = False
        self.closed = False
        self.idle_since = 0.0

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(WorkerGone(f"the worker's answer could not be read: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(WorkerGone(f"the worker closed the connection ({exc or 'no error'})"))

    # httptools callbacks
    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep = self.parser.should_keep_alive()
        if self.answer is not None and not self.answer.done():
            self.answer.set_result((self.parser.get_status_code(), b"".join(self.body)))

    def send(self, request: bytes) -> asyncio.Future:
        assert self.transport is not None
        self.answer = asyncio.get_running_loop().create_future()
        self.body = []
        self.keep = False
        self.transport.write(request)
        return self.answer

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _fail(self, error: Exception) -> None:
        self.closed = True
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(error)
        if self.transport is not None:
            self.transport.close()


class WorkerConnections:
    def __init__(self, url: str, headers: dict[str, str]) -> None:
        """url: the worker's base URL, http:// (https goes through aiohttp); headers: sent
        with every request (the worker's key)."""
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            raise ValueError(f"WorkerConnections needs an http:// URL, got {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.prefix = parts.path.rstrip("/")
        authority = parts.netloc.rsplit("@", 1)[-1]
        lines = [f"Host: {authority}", *(f"{k}: {v}" for k, v in headers.items())]
        self.head_lines = "".join(f"{line}\r\n" for line in lines)
        self.idle: deque[_Connection] = deque()

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body) of the worker's answer to a POST of JSON `body` to `path`.
        WorkerGone if the connection fails before the answer is whole."""
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\n{self.head_lines}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        conn = await self._take()
        try:
            status, answer = await conn.send(head.encode("latin-1") + body)
        except BaseException:
            conn.close()  # cancelled or failed mid-answer: the connection is not reusable
            raise
        if conn.keep and not conn.closed:
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()
        return status, answer

    async def _take(self) -> _Connection:
        now = time.monotonic()
        while self.idle and now - self.idle[0].idle_since >= KEEPALIVE_S:
            self.idle.popleft().close()  # the longest idle first
        while self.idle:
            conn = self.idle.pop()  # the most recently used
            if not conn.closed:
                return conn
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(_Connection, self.host, self.port)
        except OSError as e:
            raise WorkerGone(f"could not connect to {self.host}:{self.port}: {e!r}") from None
        return conn

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()
