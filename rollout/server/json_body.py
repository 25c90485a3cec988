"""Reading large JSON request bodies without holding the server's event loop.

FastAPI joins a body's chunks, parses them with json.loads and validates the result against the
route's model, all on the event loop: a body of tens of MB held /health and every stream for
most of a second (RESULTS.md). Routes of class OffLoopRoute (the routers' route_class) do these three on a
worker thread for a body over LARGE_BODY_BYTES, and hand FastAPI the validated model, which it
takes as it is (pydantic does not validate a model instance again).

NOTE: a thread alone does not free the loop. json.loads and pydantic are C code that holds the
GIL for the whole call, and the loop needs the GIL to answer anything. Joining releases it
(CPython drops the GIL for joins over 1 MB); the hooks below make the parser come back to
Python at each number and object, where the GIL passes to the loop if it waits. What still
holds it in one piece: decoding the bytes and scanning one long string, an array of millions
of strings or literals, and pydantic's validation of one long list (RESULTS.md has the costs).
"""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

LARGE_BODY_BYTES = 2**20  # smaller bodies take FastAPI's path: a thread hop costs more


def describe_validation_errors(errors: list[dict[str, Any]]) -> str:
    """The 400 message for FastAPI/pydantic errors (locations start with "body")."""
    parts = []
    for e in errors[:5]:
        if e.get("type") == "json_invalid":
            return "the request body is not valid JSON"
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


class OffLoopRoute(APIRoute):
    """An APIRoute whose endpoint takes one pydantic model as its body reads large bodies on a
    worker thread (see the module's doc). Other routes behave as plain APIRoutes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler

        async def read_off_loop(request: Request) -> Response:
            return await handler(OffLoopBodyRequest(request.scope, request.receive, model))

        return read_off_loop


def _body_model(route: APIRoute) -> type[BaseModel] | None:
    """The model the whole body is validated against, when the endpoint has exactly one model
    parameter (FastAPI then takes the body as that model, not embedded in a bigger one)."""
    field = route.body_field
    if field is None:
        return None
    try:
        hints = typing.get_type_hints(route.endpoint)
    except Exception:  # noqa: BLE001 - an annotation this can't resolve: FastAPI's own path
        return None
    hints.pop("return", None)
    models = [h for h in hints.values() if isinstance(h, type) and issubclass(h, BaseModel)]
    return field.field_info.annotation if models == [field.field_info.annotation] else None


class OffLoopBodyRequest(Request):
    """A Request whose body(), over LARGE_BODY_BYTES, is joined on a worker thread, and whose
    json() is parsed and validated there, giving the validated model."""

    def __init__(self, scope: dict, receive: Any, model: type[BaseModel]) -> None:
        super().__init__(scope, receive)
        self._model = model

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):  # Starlette's cache of the body, read by stream()
            chunks = [chunk async for chunk in self.stream()]
            large = sum(map(len, chunks)) > LARGE_BODY_BYTES
            self._body = await asyncio.to_thread(b"".join, chunks) if large else b"".join(chunks)
        return self._body

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > LARGE_BODY_BYTES:
                self._json = await asyncio.to_thread(parse_and_validate, body, self._model)
            else:
                self._json = json.loads(body)
        return self._json


def parse_and_validate(body: bytes, model: type[BaseModel]) -> BaseModel:
    """body as `model`. Invalid JSON raises json.JSONDecodeError (FastAPI answers it as it
    does for small bodies); a body that doesn't fit the model an HTTPException 400 with the
    message a small body would get."""
    # As json.loads(bytes) does, in two steps: each holds the GIL for half as long.
    text = body.decode(json.detect_encoding(body), "surrogatepass")
    value = json.loads(
        text, parse_int=_int, parse_float=_float, object_pairs_hook=_object
    )  # fmt: skip
    try:
        return model.model_validate(value)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False)]
        raise HTTPException(400, describe_validation_errors(errors)) from None


# The parser's results, as it makes them itself; being Python functions, each call is a point
# where the GIL can pass to the event loop (see the module's doc).
def _int(digits: str) -> int:
    return int(digits)


def _float(digits: str) -> float:
    return float(digits)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    return dict(pairs)
