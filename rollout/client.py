"""RolloutClient: the HTTP twin of RolloutEngine.

Same method names, arguments and return shapes, so a trainer moves between an in-process engine
and a `rollout serve` process by changing the line that makes it. Errors map back to the
exceptions the engine raises: bad input -> ValueError, auth -> PermissionError, the rest ->
RuntimeError. A server that cannot be reached, or drops the connection, raises
ServerUnreachable (a ConnectionError); no answer within the client's `timeout`, TimeoutError;
both name the server's URL and the route.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from rollout.control import ControlCall
from rollout.control_api import ControlAPI
from rollout.engine.control_calls import FlushCache, GetServerInfo
from rollout.engine.lora_calls import LoadLoraAdapter
from rollout.engine.messages import AbortRequest
from rollout.errors import EXCEPTIONS, HTTP, Forbidden, ServerUnreachable
from rollout.generate_request import GenerateRequest, takes_generate_request
from rollout.weight_sync import calls


class RolloutClient(ControlAPI):
    def __init__(
        self, base_url: str, api_key: str | None = None, timeout: float | None = None
    ) -> None:
        """`timeout` bounds each HTTP call in seconds (None: wait as long as generation takes).
        ValueError unless `base_url` is http(s)://host[:port][/path]."""
        check_server_url(base_url)
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = httpx.Timeout(timeout)
        self._http = httpx.Client(
            base_url=self.base_url, headers=self.headers, timeout=self.timeout
        )

    # ---- generation -----------------------------------------------------------------------
    # The arguments are GenerateRequest's fields (rollout/generate_request.py), or one
    # GenerateRequest, as RolloutEngine.generate takes them.
    @takes_generate_request
    def generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        """As RolloutEngine.generate: a dict, a list of dicts, or (stream=True) an iterator."""
        if request.stream:
            return self._stream(request.to_json())
        return self._post("/generate", request.to_json())

    def _stream(self, payload: dict) -> Iterator[dict]:
        with (
            self._reaching("/generate"),
            self._http.stream("POST", "/generate", json=payload) as resp,
        ):
            if resp.status_code != 200:
                resp.read()
                raise _error(resp)
            for line in resp.iter_lines():
                item = _event(line)
                if item is _DONE:
                    return
                if item is not None:
                    yield item

    @takes_generate_request
    async def async_generate(
        self, request: GenerateRequest
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As RolloutEngine.async_generate; cancelling closes the connection, which aborts."""
        if request.stream:
            return self._astream(request.to_json())
        with self._reaching("/generate"):
            async with self._async_http() as http:
                resp = await http.post("/generate", json=request.to_json())
        return _result(resp)

    async def _astream(self, payload: dict) -> AsyncIterator[dict]:
        with self._reaching("/generate"):
            async with (
                self._async_http() as http,
                http.stream("POST", "/generate", json=payload) as resp,
            ):
                if resp.status_code != 200:
                    await resp.aread()
                    raise _error(resp)
                async for line in resp.aiter_lines():
                    item = _event(line)
                    if item is _DONE:
                        return
                    if item is not None:
                        yield item

    def _async_http(self) -> httpx.AsyncClient:
        # A fresh async client per call: an AsyncClient belongs to the event loop that used it first.
        return httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=self.timeout)

    # ---- sessions (RolloutEngine.open_session's twins) -----------------------------------
    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        payload = {"capacity_of_str_len": capacity_of_str_len, "session_id": session_id}
        return self._post("/open_session", _present(payload))

    def close_session(self, session_id: str) -> None:
        resp = self._send("POST", "/close_session", {"session_id": session_id})
        if resp.status_code >= 400:
            raise _error(resp)

    # ---- embeddings, rewards and label scores -----------------------------------------------
    def encode(
        self, prompt: Any = None, input_ids: Any = None, normalize: bool = False, rid: Any = None
    ) -> Any:
        payload = {"text": prompt, "input_ids": input_ids, "normalize": normalize, "rid": rid}
        return self._post("/encode", _present(payload))

    def classify(
        self, prompt: Any = None, input_ids: Any = None, messages: Any = None, rid: Any = None
    ) -> Any:
        payload = {"text": prompt, "input_ids": input_ids, "messages": messages, "rid": rid}
        return self._post("/classify", _present(payload))

    def score(
        self, query: Any, items: Any, label_token_ids: list[int], apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:  # fmt: skip
        payload = {
            "query": query,
            "items": items,
            "label_token_ids": label_token_ids,
            "apply_softmax": apply_softmax,
            "item_first": item_first,
        }
        return self._post("/v1/score", payload)["scores"]

    def rerank(self, query: str, documents: list[str], top_n: int | None = None) -> list[dict]:
        """[{"index", "score", "document"}] by relevance, highest first (POST /v1/rerank)."""
        return self._post(
            "/v1/rerank", _present({"query": query, "documents": documents, "top_n": top_n})
        )

    # ---- control --------------------------------------------------------------------------
    def flush_cache(self) -> dict:
        resp = self._send("POST", f"/{FlushCache.method}")
        if resp.status_code == 409:  # not flushed (requests running): a result, not an error
            return resp.json()
        return _result(resp)

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.control(AbortRequest(rid, abort_all), omit=("session_id",))  # /close_session's

    def get_server_info(self) -> dict:
        return self._get(f"/{GetServerInfo.method}")

    def get_model_info(self) -> dict:
        return self._get("/get_model_info")

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Blocks until /health_generate answers (the model is loaded and serving)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                resp = self._http.get("/health_generate", timeout=10)
                if resp.status_code == 200:
                    return
                if resp.status_code in (401, 403):
                    raise _error(resp)
            except httpx.TransportError as e:
                last = e
            time.sleep(0.25)
        raise TimeoutError(
            f"{self.base_url} was not ready within {timeout:.0f} s (last error: {last})"
        )

    # ---- weight sync (the engine's methods, over HTTP; admin key needed when one is set) -----
    # The rest are ControlAPI's (rollout/control_api.py): each builds the engine's call (bad
    # arguments raise here) and posts its fields to the route of the same name.
    def update_weights_from_tensor(
        self, named_tensors: calls.NamedTensors, load_format: str | None = None,
        flush_cache: bool = True, weight_version: str | None = None,
        lora_name: str | None = None, abort_all_requests: bool = False,
    ) -> dict:  # fmt: skip
        """Colocated only: shares the tensors (CUDA IPC handles, or shared memory on the host)
        and sends their JSON handles; the tensors must not change until this returns."""
        args = named_tensors, load_format, flush_cache, weight_version, lora_name
        with calls.UpdateWeightsFromTensor.shared(*args, abort_all_requests) as call:
            return self.control(call)

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None,
        flush_cache: bool = True, abort_all_requests: bool = False, lora_name: str | None = None,
    ) -> dict:  # fmt: skip
        """The server reads only under its --allowed-weight-roots (else PermissionError).
        With lora_name, model_path is a PEFT adapter directory replacing that adapter."""
        call = calls.UpdateWeightsFromDisk(
            model_path, load_format, weight_version, flush_cache=flush_cache,
            abort_all_requests=abort_all_requests, lora_name=lora_name,
        )  # fmt: skip
        return self.control(call, omit=("allowed_roots",))  # the server's own, never the client's

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """The server reads only under its --allowed-weight-roots (else PermissionError)."""
        call = LoadLoraAdapter(lora_name, lora_path)
        return self.control(call, omit=("allowed_roots",))  # the server's own

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.control(calls.GetWeightsByName(name, truncate_size))

    def get_weight_version(self) -> str:
        return self._get(f"/{calls.GetWeightVersion.method}")["weight_version"]

    # ---- plumbing -------------------------------------------------------------------------
    def _post(self, path: str, payload: dict | None = None) -> Any:
        return _result(self._send("POST", path, payload))

    def control(self, call: ControlCall, omit: tuple[str, ...] = ()) -> Any:
        """Posts a control call's fields to its route (RolloutEngine.control's twin)."""
        body = {k: v for k, v in call.to_wire().items() if k not in omit}
        return self._post(f"/{call.method}", body)

    def _get(self, path: str) -> Any:
        return _result(self._send("GET", path))

    def _send(self, method: str, path: str, payload: dict | None = None) -> httpx.Response:
        """Every unstreamed call's request (the streams wrap theirs in _reaching too)."""
        with self._reaching(path):
            return self._http.request(method, path, json=payload)

    @contextlib.contextmanager
    def _reaching(self, path: str) -> Iterator[None]:
        """httpx's transport errors as ServerUnreachable / TimeoutError naming the server."""
        where = f"{self.base_url}{path}"
        try:
            yield
        except httpx.TimeoutException as e:
            raise TimeoutError(f"{where}: no answer within the client's timeout ({e!r})") from e
        except httpx.ConnectError as e:
            raise ServerUnreachable(
                f"cannot reach the rollout server at {self.base_url} ({path}): {e}; "
                "is `rollout serve` running there?"
            ) from e
        except httpx.TransportError as e:
            raise ServerUnreachable(f"lost the connection to {where}: {e!r}") from e

    def close(self) -> None:
        self._http.close()

    shutdown = close  # RolloutEngine's name: ends this client, not the server

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


_DONE = object()


def check_server_url(url: str, what: str = "server URL") -> None:
    """ValueError naming `url` unless it is http(s)://host[:port][/path]."""
    parts = urlsplit(url) if isinstance(url, str) else None
    try:
        port_ok = parts is not None and (parts.port is None or 0 < parts.port < 65536)
    except ValueError:
        port_ok = False
    if not port_ok or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {url!r} is not http(s)://host[:port]")


def _present(payload: dict) -> dict:
    return {k: v for k, v in payload.items() if v is not None}


def _event(line: str) -> Any:
    """One SSE line -> a dict, _DONE, or None (blank lines, comments). Error events raise."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    item = json.loads(data)
    if isinstance(item, dict) and "error" in item and "meta_info" not in item:
        raise _exception(item["error"].get("code", 500), item["error"].get("message", data))
    return item


_KINDS = {status: kind for kind, (status, _) in HTTP.items()}


def _exception(status: int, message: str) -> Exception:
    """The engine's exception for an HTTP error (the kinds of rollout/errors.py); any other 4xx
    is a bad request, any other status a failure of the server's."""
    if status in (401, 403):  # no key, a wrong key, or not this key's to do
        return Forbidden(f"HTTP {status}: {message}")
    kind = _KINDS.get(status, "invalid" if 400 <= status < 500 else "internal")
    if kind == "internal":
        return RuntimeError(f"HTTP {status}: {message}")
    return EXCEPTIONS[kind](message)


def _error(resp: httpx.Response) -> Exception:
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text
    return _exception(resp.status_code, message)


def _result(resp: httpx.Response) -> Any:
    if resp.status_code >= 400:
        raise _error(resp)
    return resp.json()
