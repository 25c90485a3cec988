"""SGLang-native endpoints: /generate, health, info, load, cache and abort, metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, SkipValidation

from rollout.engine.messages import AbortRequest
from rollout.server.json_body import OffLoopRoute
from rollout.server.openai_format import TokenText
from rollout.server.responses import JSON, error, is_large, json_response
from rollout.server.streaming import (
    error_event,
    first_item,
    sse,
    sse_event,
    sse_response,
    until_disconnect,
)

router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop

# Token ids are checked by the engine, on its worker threads. pydantic would check them in one
# C call holding the GIL throughout, so the event loop would wait on it for a long list.
TokenIds = SkipValidation[list[int] | list[list[int]] | None]

HEALTH_GENERATE_TIMEOUT_S = 30.0


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: TokenIds = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    token_ids_logprob: list[int] | None = None
    return_hidden_states: bool = False
    return_text_in_logprobs: bool = False  # fill each logprob entry's third element with its text
    stream: bool = False
    rid: str | list[str] | None = None


class AbortRequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    abort_all: bool = False


def _engine(request: Request) -> Any:
    return request.app.state.engine


# The fields of GenerateRequest that are not engine.async_generate's arguments.
_SERVER_FIELDS = frozenset({"text", "return_text_in_logprobs", "stream"})


def add_token_text(out: dict, text_of: TokenText) -> None:
    """(logprob, id, None) -> (logprob, id, text) in every logprob list of one output."""
    meta = out["meta_info"]

    def fill(entry: Any) -> Any:
        if entry is None:
            return None
        if isinstance(entry, (list, tuple)) and entry and isinstance(entry[0], (list, tuple)):
            return [fill(e) for e in entry]
        return (entry[0], entry[1], text_of(entry[1]))

    for key, value in meta.items():
        if key.endswith("_logprobs") and isinstance(value, list):
            meta[key] = [fill(e) for e in value]


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    engine, metrics = _engine(request), request.app.state.metrics
    owners, role = request.app.state.owners, request.state.role
    # The fields as they are: model_dump would copy a long input_ids on the event loop.
    kwargs = {k: getattr(body, k) for k in GenerateRequest.model_fields if k not in _SERVER_FIELDS}
    kwargs["prompt"] = body.text
    start = time.monotonic()
    text_of = TokenText(engine.tokenizer)  # one cache for all the outputs of this request

    def finish(out: Any) -> Any:
        if body.return_text_in_logprobs:
            for one in out if isinstance(out, list) else [out]:
                add_token_text(one, text_of)
        return out

    if not body.stream:
        with owners.claim(body.rid, role):
            result = await until_disconnect(request, engine.async_generate(**kwargs))
        outs = result if isinstance(result, list) else [result]
        metrics.observe("generate", outs, time.monotonic() - start)
        if is_large(result):  # decoding a million logprob entries' texts is seconds of work
            return await json_response(await asyncio.to_thread(finish, result))
        return await json_response(finish(result))

    stream = owners.stream(engine.async_generate(**kwargs, stream=True), body.rid, role)
    first, rest = await first_item(stream)
    metrics.ttft.observe(time.monotonic() - start)

    async def events() -> AsyncIterator[str | bytes]:
        last = first
        try:
            yield await sse_event(first, finish)
            async for out in rest:
                last = out
                yield await sse_event(out, finish)
        except Exception as e:  # noqa: BLE001 - the 200 is sent: the error goes in the stream
            yield error_event(e, request)
        else:
            metrics.observe("generate", [last], time.monotonic() - start)
        yield sse("[DONE]")

    return sse_response(events(), request)


@router.get("/health")
async def health(request: Request) -> JSON:
    if not _engine(request).is_alive():
        return error(503, "the engine is not running", "server_error")
    return JSON({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> JSON:
    """Readiness: one token through tokenizer manager, scheduler, model and detokenizer."""
    engine = _engine(request)
    if engine.options.model.is_embedding:  # prefill-only: one prompt through encode
        work = engine.async_encode(input_ids=[0])
    else:
        work = engine.async_generate(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0})
    try:
        await asyncio.wait_for(work, HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error(503, f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s", "server_error")
    return JSON({"status": "ok"})


@router.get("/get_model_info")
def get_model_info(request: Request) -> dict:
    engine = _engine(request)
    opts = engine.options.model
    return {
        "model_path": opts.model_path,
        "tokenizer_path": opts.tokenizer_path or opts.model_path,
        "served_model_name": request.app.state.model_name,
        "is_generation": not opts.is_embedding,
        "architecture": engine.info.get("architecture"),
        "vocab_size": engine.info.get("vocab_size"),
        "context_length": engine.info.get("context_length"),
        "weight_version": engine.get_server_info().get("weight_version"),
    }


@router.get("/get_server_info")
def get_server_info(request: Request) -> dict:
    options = request.app.state.options
    public = {"host": options.host, "port": options.port, "auth": options.api_key is not None}
    return {**_engine(request).get_server_info(), "server": public}


@router.get("/get_load")
def get_load(request: Request) -> list[dict]:
    info = _engine(request).get_server_info()
    return [
        {
            "dp_rank": 0,
            "num_reqs": info["num_running"] + info["num_waiting"],
            "num_running_reqs": info["num_running"],
            "num_waiting_reqs": info["num_waiting"],
            "num_tokens": info["kv_total"] - info["kv_free"],
        }
    ]


@router.post("/flush_cache")
def flush_cache(request: Request) -> JSON:
    result = _engine(request).flush_cache()
    return JSON(result, status_code=200 if result.get("success") else 409)


@router.post("/abort_request")
def abort_request(body: AbortRequestBody, request: Request) -> JSON:
    """Aborts one request by rid, or all (admin only). A user key may abort only requests sent
    with the user key; someone else's rid answers as an unknown rid does, so the answer doesn't
    tell whether it exists."""
    role = request.state.role
    call = AbortRequest(body.rid, body.abort_all)  # 400 unless it names what to abort
    if call.abort_all and role != "admin":
        return error(403, "abort_all needs the admin API key", "permission_error")
    if call.abort_all or request.app.state.owners.may_abort(call.rid, role):
        _engine(request).abort_request(rid=call.rid, abort_all=call.abort_all)
    return JSON({"success": True})


@router.get("/metrics")
def metrics(request: Request) -> Response:
    text = request.app.state.metrics.render(_engine(request).get_server_info())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
