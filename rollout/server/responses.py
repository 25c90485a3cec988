"""The JSON response used by every route, the error body shape, and what of an exception a
client may see."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rollout.engine.messages import public_error
from rollout.engine.tokenizer_manager import EngineDeadError, RequestFailedError
from rollout.errors import HTTP, kind_of
from rollout.server.json_render import dumps, estimate_items, render_in_pieces

logger = logging.getLogger(__name__)

# Above this many JSON values (about where json.dumps holds the GIL for as long as a /health
# answer may take) an answer is made off the event loop.
LARGE_RESPONSE_ITEMS = 65_536


class JSON(JSONResponse):
    """JSON that tolerates non-finite floats (a -inf logprob is a value, not a server error)."""

    def render(self, content: Any) -> bytes:
        return dumps(content).encode()


def is_large(content: Any) -> bool:
    """Whether making `content` into JSON (or walking it) would hold the event loop too long."""
    return estimate_items(content) > LARGE_RESPONSE_ITEMS


async def json_response(content: Any, status_code: int = 200) -> Response:
    """`content` as a JSON answer, the same as a route returning it gives, made without holding
    the event loop: large content is rendered on a worker thread, in pieces (see json_render).
    Routes that can answer with much (logprobs, embeddings) return this rather than a dict,
    which FastAPI would walk (jsonable_encoder, in Python, per value) on the loop."""
    if not is_large(content):
        return JSON(content, status_code=status_code)
    body = await asyncio.to_thread(render_in_pieces, content)
    return Response(body, status_code=status_code, media_type="application/json")


def error(status: int, message: str, kind: str = "invalid_request_error") -> JSON:
    return JSON({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def describe_failure(exc: BaseException, where: str) -> tuple[int, str, str]:
    """(status, message, type) for an exception raised while serving a request at `where`.

    The caller's mistakes (a RequestError: rollout/errors.py) and a failed weight transfer get
    the status of their kind and their message as is. A request the engine failed
    (RequestFailedError, 500) and a dead engine (EngineDeadError, 503) get their short messages
    (the engine logged the details). Anything else is a bug of ours, whatever its type (a
    ValueError too): logged under a fresh error id, with its trace, and the client gets only
    the id: tracebacks and file paths stay in the log."""
    kind = kind_of(exc)
    if kind != "internal":
        status, type_ = HTTP[kind]
        return status, str(exc), type_
    if isinstance(exc, RequestFailedError):
        return 500, public_error(str(exc)), "server_error"
    if isinstance(exc, EngineDeadError):
        return 503, f"the engine is not serving: {public_error(str(exc))}", "server_error"
    error_id = uuid.uuid4().hex[:12]
    logger.error("error %s in %s", error_id, where, exc_info=exc)
    return (
        500,
        f"internal error (error id {error_id}; the server log has the details)",
        "server_error",
    )


def failure(exc: BaseException, where: str) -> JSON:
    return error(*describe_failure(exc, where))


def check_model(request: Request, model: str) -> JSON | None:
    """A 404 unless `model` names what this server serves: its served name or model path, or
    "<that>:<adapter>" for a LoRA adapter (whether it is loaded, the engine checks)."""
    known = {request.app.state.model_name, request.app.state.engine.options.model.model_path}
    base, _, adapter = model.rpartition(":")
    if model not in known and not (base in known and adapter):
        return error(
            404,
            f"model {model!r} is not served here; use {request.app.state.model_name!r} (or "
            f"'{request.app.state.model_name}:<adapter>' for a loaded LoRA adapter)",
            "model_not_found",
        )
    return None


def model_adapter(request: Request, model: str) -> str | None:
    """The LoRA adapter a checked `model` names ("<base>:<adapter>"), None for the base."""
    known = {request.app.state.model_name, request.app.state.engine.options.model.model_path}
    return None if model in known else model.rpartition(":")[2]
