"""A replica that is a `rollout serve` worker, reached over HTTP (the `rollout router`'s).

Generation goes through one kept async connection pool (a request is one POST /generate, a
stream its server-sent events); control calls through RolloutClient's methods on a thread.
The router cannot start a worker itself: when one dies, its supervisor (systemd, Kubernetes,
a shell loop) starts it again, and the pool takes it back, with the current weights, once its
/health answers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from rollout.client import RolloutClient
from rollout.engine.tokenizer_manager import RequestFailedError
from rollout.errors import EXCEPTIONS, HTTP, Forbidden
from rollout.generate_request import GenerateRequest
from rollout.pool.replica import Replica, ReplicaDead

DEAD_STATUSES = (503, 504)  # the worker (or a gateway before it) says it is not serving
_KINDS = {status: kind for kind, (status, _) in HTTP.items()}


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
        self._http: httpx.AsyncClient | None = None

    async def start(self) -> dict:
        deadline = time.monotonic() + self.start_timeout_s
        while not await self.alive():
            if time.monotonic() > deadline:
                raise ReplicaDead(f"{self.name} did not answer /health in {self.start_timeout_s} s")
            await asyncio.sleep(0.5)
        info = await self.call("get_server_info")
        self.ranks = int(info.get("tp_size", 1))
        return info

    def _async(self) -> httpx.AsyncClient:
        # Made on first use: it then belongs to the pool's event loop, the only one using it.
        if self._http is None:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._http = httpx.AsyncClient(
                base_url=self.url, headers=self.headers, timeout=None, limits=limits
            )
        return self._http

    async def generate(self, request: GenerateRequest) -> Any:
        try:
            resp = await self._async().post("/generate", json=request.to_json())
        except httpx.TransportError as e:
            raise ReplicaDead(f"{self.name} is unreachable: {e!r}") from None
        if resp.status_code != 200:
            raise self._error(resp.status_code, _message(resp))
        return resp.json()

    async def stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        try:
            async with self._async().stream("POST", "/generate", json=request.to_json()) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise self._error(resp.status_code, _message(resp))
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    item = json.loads(data)
                    if isinstance(item, dict) and "error" in item and "meta_info" not in item:
                        err = item["error"]
                        raise self._error(err.get("code", 500), err.get("message", data))
                    yield item
        except httpx.TransportError as e:
            raise ReplicaDead(f"{self.name} is unreachable: {e!r}") from None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(self._call, method, args, kwargs)

    def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        kwargs.pop("allowed_roots", None)  # the worker reads only under its own roots
        try:
            fn = getattr(self.client, method, None)
            if fn is None:  # a call this client has no method for yet: posted by name
                return self._post(method, kwargs)
            return fn(*args, **kwargs)
        except httpx.TransportError as e:
            raise ReplicaDead(f"{self.name} is unreachable: {e!r}") from None
        except RuntimeError as e:
            status = str(e).split(":")[0]
            if status in {f"HTTP {s}" for s in DEAD_STATUSES}:
                raise ReplicaDead(f"{self.name}: {e}") from None
            raise

    def _post(self, method: str, body: dict) -> Any:
        resp = httpx.post(f"{self.url}/{method}", json=body, headers=self.headers, timeout=None)
        if resp.status_code != 200:
            raise self._error(resp.status_code, _message(resp))
        return resp.json()

    async def alive(self) -> bool:
        try:
            resp = await self._async().get("/health", timeout=10)
        except httpx.TransportError:
            return False
        return resp.status_code == 200

    async def stop(self) -> None:
        http, self._http = self._http, None
        if http is not None:
            await http.aclose()
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


def _message(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.text
