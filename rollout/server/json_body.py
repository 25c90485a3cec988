"""Reading large JSON request bodies without holding the server's event loop.

FastAPI joins a body's chunks, parses them with json.loads and validates the result against the
route's model, all on the event loop: a body of tens of MB held /health and every stream for
most of a second (RESULTS.md). Routes of class OffLoopRoute (the routers' route_class) do these
three on a worker thread for a body over LARGE_BODY_BYTES, and hand FastAPI the validated model,
which it takes as it is (pydantic does not validate a model instance again).

NOTE: a thread alone does not free the loop. json.loads and pydantic are C code that holds the
GIL for the whole call, and the loop needs the GIL to answer anything. Joining releases it
(CPython drops the GIL for joins over 1 MB); json_parse gives the C scanner bounded pieces; and
json_release frees the parsed body a piece at a time, when validation fails and when the
request is done, on a worker thread (freeing ten million items is one C call too); and no
garbage collection walks a large body while it lives (json_collection_pause). What still
holds it in one piece: pydantic's validation of one long list (RESULTS.md has the costs), and
what the route's own code does with the body.
"""

from __future__ import annotations

import asyncio
import json
import typing
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from rollout.server.json_collection_pause import collections_paused
from rollout.server.json_parse import TooManyContainers, decode_body, parse
from rollout.server.json_release import release

# Every request body's models, nested ones too (a model's config is its own): unknown fields are
# an error, and values are taken as sent ("2" is no int, "yes" no bool; an int is a float).
BODY_CONFIG = ConfigDict(extra="forbid", strict=True)

LARGE_BODY_BYTES = 2**20  # smaller bodies take FastAPI's path: a thread hop costs more
_PARSED = "rollout.parsed_body"  # scope key: the validated models of large bodies, to release
_HELD = "rollout.collections_held"  # scope key: the collection pauses its large bodies hold


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
    worker thread (see the module's doc), and releases what is left of them once the answer is
    sent. Other routes behave as plain APIRoutes."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = _body_model(self)
        if model is None:
            return handler

        async def read_off_loop(request: Request) -> Response:
            off_loop = OffLoopBodyRequest(request.scope, request.receive, model)
            try:
                return await handler(off_loop)
            finally:
                # The request may outlive its answer (a task that watches for a disconnect
                # is cancelled, but not yet ended, when handle releases the body): it must not
                # hold the body then, or the body is freed in one piece when that task ends.
                off_loop.forget_body()

        return read_off_loop

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().handle(scope, receive, send)
        finally:
            # The answer is sent and the route's frames are gone: what is left of a large body
            # is held here alone, unless the engine still holds a part of it.
            parsed = scope.pop(_PARSED, None)
            try:
                if parsed:
                    await asyncio.to_thread(release, parsed)
            finally:
                for _ in range(scope.pop(_HELD, 0)):
                    collections_paused.let_go()


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
    json() is parsed and validated there, giving the validated model (which goes in the scope
    too, for OffLoopRoute.handle to release)."""

    def __init__(self, scope: dict, receive: Any, model: type[BaseModel]) -> None:
        super().__init__(scope, receive)
        self._model = model

    def forget_body(self) -> None:
        """Drops the body and its parsed value, once the route is done with them."""
        self.__dict__.pop("_json", None)
        self.__dict__.pop("_body", None)

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
                # No collection walks the parsed body while it lives (json_collection_pause);
                # OffLoopRoute.handle lets go once it is released.
                collections_paused.hold()
                self.scope[_HELD] = self.scope.get(_HELD, 0) + 1
                # The model comes back in `parsed`, not as the thread's result: the futures
                # that carry a result may outlive the request (the event loop drops its last
                # callback a turn later), and would free the body in one piece where they go.
                parsed = self.scope.setdefault(_PARSED, [])
                await asyncio.to_thread(_parse_into, parsed, body, self._model)
                self._json = parsed[-1]
            else:
                self._json = json.loads(body)
        return self._json


def _parse_into(parsed: list[BaseModel], body: bytes, model: type[BaseModel]) -> None:
    parsed.append(parse_and_validate(body, model))


def parse_and_validate(body: bytes, model: type[BaseModel]) -> BaseModel:
    """body as `model`. Invalid JSON raises json.JSONDecodeError (FastAPI answers it as it
    does for small bodies); a body that doesn't fit the model an HTTPException 400 with the
    message a small body would get. The parsed value is released (json_release) before this
    returns: what the model keeps of it is the model's."""
    with collections_paused():
        try:
            parsed = [parse(decode_body(body))]
        except TooManyContainers as e:
            raise HTTPException(400, str(e)) from None
        try:
            return model.model_validate(parsed[0])
        except ValidationError as e:
            # Without their inputs: an error's input may be a long list, to release here.
            errors = [
                {**_without_input(err), "loc": ("body", *err["loc"])}
                for err in e.errors(include_url=False)[:5]
            ]
        finally:
            release(parsed)
    raise HTTPException(400, describe_validation_errors(errors))


def _without_input(error: Any) -> dict[str, Any]:
    return {k: v for k, v in error.items() if k != "input"}
