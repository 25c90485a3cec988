"""A replica that is a `rollout serve` worker, reached over HTTP (the `rollout router`'s).

A /generate answered whole goes over the replica's own kept connections (worker_connections.py:
the least a request can cost the router), a stream's server-sent events through one kept aiohttp
connection pool. Control calls, rare and slow, go through RolloutClient's methods on a thread.
The router cannot start a worker itself: when one dies, its supervisor (systemd, Kubernetes,
a shell loop) starts it again, and the pool takes it back, with the current weights, once its
/health answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx

from rollout.client import RolloutClient, check_server_url
from rollout.engine.tokenizer_manager import RequestFailedError
from rollout.errors import EXCEPTIONS, HTTP, Forbidden, ServerUnreachable
from rollout.generate_request import GenerateRequest
from rollout.pool.replica import Replica, ReplicaDead
from rollout.pool.worker_connections import WorkerConnections, WorkerGone

logger = logging.getLogger(__name__)

DEAD_STATUSES = (503, 504)  # the worker (or a gateway before it) says it is not serving
# Idle connections are closed before the worker's server closes them (uvicorn: after 5 s), so
# that a request never goes out on a connection the worker is closing.
KEEPALIVE_S = 4.0
HEALTH_TIMEOUT_S = 10.0
# The worker gone, or its answer cut off (aiohttp.ClientError), or a socket error.
_UNREACHABLE = (aiohttp.ClientError, OSError)
JSON_TYPE = {"Content-Type": "application/json"}
_KINDS = {status: kind for kind, (status, _) in HTTP.items()}


def check_worker_urls(urls: list[str]) -> None:
    """ValueError naming the first worker URL that is not http(s)://host[:port][/path], or one
    given twice (its requests would be counted as two workers' loads)."""
    if not urls:
        raise ValueError("worker_urls must name at least one worker")
    seen = set()
    for url in urls:
        check_server_url(url, "worker URL")
        key = url.rstrip("/")
        if key in seen:
            raise ValueError(f"worker URL {url!r} is given twice")
        seen.add(key)


class HttpReplica(Replica):
    restartable = False

    def __init__(
        self, index: int, url: str, api_key: str | None = None, start_timeout_s: float = 120.0
    ) -> None:
        self.index, self.url = index, url.rstrip("/")
        self.name = f"replica {index} ({self.url})"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = RolloutClient(self.url, api_key=api_key)
        self.start_timeout_s = start_timeout_s
        self.generate_url = f"{self.url}/generate"
        self._http: aiohttp.ClientSession | None = None
        # A /generate answered whole goes over kept connections of its own (worker_connections.py).
        http = self.url.startswith("http://")
        self.connections = WorkerConnections(self.url, self.headers) if http else None

    async def start(self) -> dict:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = False
        while not await self.alive():
            if time.monotonic() > deadline:
                raise ReplicaDead(f"{self.name} did not answer /health in {self.start_timeout_s} s")
            if not waiting:  # a router started before its workers says what it waits for
                waiting = True
                logger.warning(
                    "rollout pool: waiting up to %.0f s for %s to answer /health",
                    self.start_timeout_s, self.name,
                )  # fmt: skip
            await asyncio.sleep(0.5)
        info = await self.call("get_server_info")
        self.ranks = int(info.get("tp_size", 1))
        return info

    def _session(self) -> aiohttp.ClientSession:
        # Made on first use: it then belongs to the pool's event loop, the only one using it.
        if self._http is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self._http = aiohttp.ClientSession(
                headers=self.headers, connector=connector,
                timeout=aiohttp.ClientTimeout(total=None),
            )  # fmt: skip
        return self._http

    def _post_generate(self, body: bytes) -> Any:
        return self._session().post(self.generate_url, data=body, headers=JSON_TYPE)

    async def generate(self, request: GenerateRequest) -> Any:
        return json.loads(await self.relay(_body(request)))

    async def stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        async for events in self.relay_stream(_body(request)):
            for line in events.split(b"\n"):
                if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
                    yield json.loads(data)

    async def relay(self, body: bytes) -> bytes:
        """The worker's JSON answer to a /generate body (stream false), as it is."""
        try:
            if self.connections is not None:
                status, answer = await self.connections.post("/generate", body)
            else:
                async with self._post_generate(body) as resp:
                    status, answer = resp.status, await resp.read()
        except (*_UNREACHABLE, WorkerGone) as e:
            raise ReplicaDead(f"{self.name} is unreachable: {e!r}") from None
        if status != 200:
            raise self._error(status, _message(answer))
        return answer

    async def relay_stream(self, body: bytes) -> AsyncIterator[bytes]:
        """The worker's server-sent events for a /generate body (stream true), as they come,
        whole events only (up to and with their blank line), its `data: [DONE]` included. An
        error event is raised as the engine's exception of its code."""
        error = None  # raised out of the try: Forbidden is an OSError
        try:
            async with self._post_generate(body) as resp:
                if resp.status != 200:
                    error = self._error(resp.status, _message(await resp.read()))
                else:
                    async for events in _events(resp.content):
                        at = events.find(b'data: {"error"')
                        if at >= 0 and (error := self._error_event(events[at:])) is not None:
                            if at:
                                yield events[:at]
                            break
                        yield events
        except _UNREACHABLE as e:
            raise ReplicaDead(f"{self.name} is unreachable: {e!r}") from None
        if error is not None:
            raise error

    def _error_event(self, events: bytes) -> Exception | None:
        """The exception of the error event that `events` starts with, if it is one."""
        item = json.loads(events.split(b"\n", 1)[0][5:])
        if not (isinstance(item, dict) and "error" in item and "meta_info" not in item):
            return None
        err = item["error"]
        return self._error(err.get("code", 500), err.get("message", str(err)))

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self._call, method, args, kwargs)

    def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        kwargs.pop("allowed_roots", None)  # the worker reads only under its own roots
        try:
            fn = getattr(self.client, method, None)
            if fn is None:  # a call this client has no method for yet: posted by name
                return self._post(method, kwargs)
            return fn(*args, **kwargs)
        except (httpx.TransportError, ServerUnreachable, TimeoutError) as e:
            raise ReplicaDead(f"{self.name} is unreachable: {e!r}") from None
        except RuntimeError as e:
            status = str(e).split(":")[0]
            if status in {f"HTTP {s}" for s in DEAD_STATUSES}:
                raise ReplicaDead(f"{self.name}: {e}") from None
            raise

    def _post(self, method: str, body: dict) -> Any:
        resp = httpx.post(f"{self.url}/{method}", json=body, headers=self.headers, timeout=None)
        if resp.status_code != 200:
            raise self._error(resp.status_code, _message(resp.content))
        return resp.json()

    async def alive(self) -> bool:
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        try:
            async with self._session().get(f"{self.url}/health", timeout=timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (*_UNREACHABLE, asyncio.TimeoutError):
            return False

    async def stop(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.close()
        if self.connections is not None:
            self.connections.close()
        self.client.close()

    def _error(self, status: int, message: str) -> Exception:
        """The engine's exception for a worker's error answer (its kinds: rollout/errors.py)."""
        if status in DEAD_STATUSES:
            return ReplicaDead(f"{self.name}: HTTP {status}: {message}")
        if status in (401, 403):
            return Forbidden(f"{self.name} refused the router's key: HTTP {status}: {message}")
        kind = _KINDS.get(status, "invalid" if 400 <= status < 500 else "internal")
        if kind == "internal":
            return RequestFailedError(message)
        return EXCEPTIONS[kind](message)


def _message(body: bytes) -> str:
    """The message of a worker's error answer (`{"error": {"message": ...}}`), else its text."""
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


def _body(request: GenerateRequest) -> bytes:
    return json.dumps(request.to_json(), separators=(",", ":")).encode()


async def _events(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """A body's server-sent events as they come, whole ones only (each ends with a blank line),
    of any length (StreamReader's own line reading refuses lines longer than its buffer: an
    event with many logprobs can be longer)."""
    held: list[bytes] = []
    async for chunk in content.iter_any():
        end = chunk.rfind(b"\n\n")
        if end >= 0:
            cut = end + 2
        elif chunk.startswith(b"\n") and held and held[-1].endswith(b"\n"):
            cut = 1  # the blank line spans two chunks
        else:
            held.append(chunk)
            continue
        held.append(chunk[:cut])
        yield b"".join(held)
        held = [chunk[cut:]] if cut < len(chunk) else []
    if any(piece.strip() for piece in held):
        yield b"".join(held)
