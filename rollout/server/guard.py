"""ASGI middleware in front of every route: API keys, the request-body size limit, and refusing
new requests once the server is shutting down.

Pure ASGI (not BaseHTTPMiddleware) so streamed responses and client disconnects pass through
untouched: a disconnect must reach the streaming route, which aborts its request.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException

from rollout.server.options import ServerOptions

OPEN_PATHS = frozenset({"/health"})
GUARDED = "rollout.guarded"  # scope key: a Guard has checked this request (an outer one)
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/get_weights_by_name",
        "/update_weight_version",
        "/pause_generation",
        "/continue_generation",
        "/discard_staged_weights",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/load_lora_adapter",
        "/unload_lora_adapter",
    }
)


class BodyTooLarge(HTTPException):
    """413. An HTTPException: FastAPI passes those through when reading a body fails (any other
    error while reading becomes its generic 400), so a chunked body over the limit is a 413 too."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is larger than the limit of {limit} bytes")

    def __str__(self) -> str:
        return str(self.detail)


def _same(a: str | None, b: str | None) -> bool:
    return a is not None and b is not None and hmac.compare_digest(a.encode(), b.encode())


def caller_role(options: ServerOptions, token: str | None) -> str | None:
    """"admin", "user" or None (unauthenticated, where a key is required)."""
    if _same(token, options.admin_api_key):
        return "admin"
    if options.api_key is None:
        return "admin" if options.admin_api_key is None else "user"
    if _same(token, options.api_key):
        return "user" if options.admin_api_key is not None else "admin"
    return None


def _bearer(scope: dict) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return bearer_token(value)
    return None


def bearer_token(value: bytes) -> str | None:
    """The key of an Authorization header's value ("Bearer KEY"), None for another scheme."""
    text = value.decode("latin-1")
    return text[7:].strip() if text[:7].lower() == "bearer " else None


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def send_error(send: Any, status: int, message: str, kind: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """`state.stopping` (the app's state) set: every new request gets 503 (the server is
    draining: requests in flight are being aborted and it exits once they have answered).
    A request checked by a Guard around this one passes as it is (rollout router's relay)."""

    def __init__(self, app: Any, options: ServerOptions, state: Any) -> None:
        self.app = app
        self.options = options
        self.state = state

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or GUARDED in scope:
            await self.app(scope, receive, send)
            return
        if getattr(self.state, "stopping", False):
            await send_error(send, 503, "the server is shutting down", "server_error")
            return
        path = scope["path"].rstrip("/") or "/"
        token = _bearer(scope)
        role = caller_role(self.options, token)
        known = _same(token, self.options.api_key) or _same(token, self.options.admin_api_key)
        if path not in OPEN_PATHS and (
            (role is None) or (path in ADMIN_PATHS and role != "admin" and not known)
        ):
            message = "missing or wrong API key (Authorization: Bearer KEY)"
            await send_error(send, 401, message, "auth_error")
            return
        if path in ADMIN_PATHS and role != "admin":
            await send_error(send, 403, f"{path} needs the admin API key", "permission_error")
            return
        scope.setdefault("state", {})["role"] = role
        scope[GUARDED] = True
        _default_to_json(scope)
        limit = self.options.max_request_bytes
        length = _content_length(scope)
        if length is not None and length > limit:
            await send_error(send, 413, str(BodyTooLarge(limit)), "invalid_request_error")
            return
        await self.app(scope, _limited(receive, limit), send)


def _default_to_json(scope: dict) -> None:
    """Bodies sent without a JSON content type (`curl -d '{...}'`) are read as JSON, as SGLang
    does."""
    headers = [(k, v) for k, v in scope.get("headers", ()) if k != b"content-type"]
    kind = dict(scope.get("headers", ())).get(b"content-type", b"")
    if kind.split(b";")[0].strip() in (b"", b"application/x-www-form-urlencoded", b"text/plain"):
        scope["headers"] = [*headers, (b"content-type", b"application/json")]


def _limited(receive: Any, limit: int) -> Any:
    """`receive`, failing once the body exceeds `limit` (bodies sent without a content-length)."""
    seen = 0

    async def wrapped() -> dict:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
        return message

    return wrapped
