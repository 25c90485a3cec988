"""SGLang-native endpoints: /generate, health, info, load, cache and abort, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import traceback
import typing
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, SkipValidation, create_model

from rollout import __version__
from rollout.engine.messages import AbortRequest
from rollout.errors import RequestError
from rollout.generate_request import WIRE_NAMES, GenerateRequest
from rollout.server.json_body import BODY_CONFIG, OffLoopRoute
from rollout.server.loads import loads_report
from rollout.server.responses import JSON, error, json_response
from rollout.server.stream_fanout import is_fanout, open_fanout
from rollout.server.streaming import (
    error_event,
    first_item,
    sse,
    sse_event,
    sse_response,
    until_disconnect,
)

router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop

# Token ids and prompt lists are checked by the engine, on its worker threads. pydantic would
# check them in one C call holding the GIL throughout (and make one error per bad item), so the
# event loop would wait on it for a long list.
TokenIds = SkipValidation[list[int] | list[list[int]] | None]
Prompts = SkipValidation[str | list[str] | None]
# The fields of GenerateRequest that are lists of any length.
_UNCHECKED = {"input_ids": TokenIds, "prompt": Prompts}

HEALTH_GENERATE_TIMEOUT_S = 30.0


def _generate_body() -> type[BaseModel]:
    """The JSON body of /generate: GenerateRequest's fields under their JSON names."""
    hints = typing.get_type_hints(GenerateRequest)
    body: dict[str, Any] = {}
    for f in dataclasses.fields(GenerateRequest):
        kind = _UNCHECKED.get(f.name, hints[f.name])
        body[WIRE_NAMES.get(f.name, f.name)] = (kind, f.default)
    # Strict: "yes" is no bool and "0" no int here, as in the Python API (GenerateRequest).
    return create_model("GenerateBody", __config__=BODY_CONFIG, **body)


GenerateBody = _generate_body()


class AbortRequestBody(BaseModel):
    model_config = BODY_CONFIG  # "abort_all": "yes" is no bool

    rid: str | None = None
    abort_all: bool = False


class OpenSessionBody(BaseModel):
    model_config = BODY_CONFIG  # as the engine: 10.0 is no int

    capacity_of_str_len: int
    session_id: str | None = None


class CloseSessionBody(BaseModel):
    model_config = BODY_CONFIG

    session_id: str


def _engine(request: Request) -> Any:
    return request.app.state.engine


@router.post("/generate")
async def generate(body: GenerateBody, request: Request) -> Any:
    engine, metrics = _engine(request), request.app.state.metrics
    owners, role = request.app.state.owners, request.state.role
    # The fields as they are: model_dump would copy a long input_ids on the event loop.
    call = GenerateRequest.from_json({k: getattr(body, k) for k in GenerateBody.model_fields})
    start = time.monotonic()

    if not body.stream:
        log_metrics = call.log_metrics
        refusal = None
        try:
            with owners.claim(call.rid, role):
                result = await until_disconnect(request, engine.async_generate(call))
        except RequestError as e:
            # A refused body is freed a piece at a time after the answer (json_body), unless
            # something else still holds it then: this frame, or the error's traceback, whose
            # frames (the engine's checks, until_disconnect's) hold the request and, through
            # until_disconnect's task, the error itself. That cycle would be freed by a garbage
            # collection, the body with it in one piece: its frames are cleared here, and the
            # refusal is raised outside this block, so that it holds neither them nor the error.
            traceback.clear_frames(e.__traceback__)
            refusal = type(e)(*e.args)
        if refusal is not None:
            del call, body
            try:
                raise refusal
            finally:
                refusal = None  # else its traceback holds this frame, which holds it: a cycle
        outs = result if isinstance(result, list) else [result]
        if log_metrics:
            metrics.observe("generate", outs, time.monotonic() - start)
        return await json_response(result)

    # A batch or n > 1 streams every sample, each event with its index (SGLang's shape).
    opened = open_fanout(engine, call) if is_fanout(call) else engine.async_generate(call)
    stream = owners.stream(opened, call.rid, role)
    first, rest = await until_disconnect(request, first_item(stream))
    if call.log_metrics:
        metrics.ttft.observe(time.monotonic() - start)

    async def events() -> AsyncIterator[str | bytes]:
        lasts = {first.get("index", 0): first}  # each sample's latest output
        try:
            yield await sse_event(first)
            async for out in rest:
                lasts[out.get("index", 0)] = out
                yield await sse_event(out)
        except Exception as e:  # noqa: BLE001 - the 200 is sent: the error goes in the stream
            yield error_event(e, request)
        else:
            if call.log_metrics:
                metrics.observe("generate", list(lasts.values()), time.monotonic() - start)
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
        work = engine.async_generate(
            input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0}
        )
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
        "model_path": engine.info.get("model_path") or opts.model_path,  # follows disk updates
        "tokenizer_path": opts.tokenizer_path or opts.model_path,
        "served_model_name": request.app.state.model_name,
        "is_generation": not opts.is_embedding,
        "architecture": engine.info.get("architecture"),
        "vocab_size": engine.info.get("vocab_size"),
        "context_length": engine.info.get("context_length"),
        "weight_version": engine.get_server_info().get("weight_version"),
    }


@router.get("/get_server_info")
@router.get("/server_info")  # SGLang's newer name
def get_server_info(request: Request) -> dict:
    options = request.app.state.options
    public = {"host": options.host, "port": options.port, "auth": options.api_key is not None}
    info = _engine(request).get_server_info()
    # The server-args names SGLang's clients read (slime checks them before an update).
    dp_size = len(info.get("replicas") or [None])  # a pool's replicas (rollout serve --dp-size)
    # A pool none of whose replicas answered (all restarting) knows no sizes: None, not a 500.
    sglang = {
        "dp_size": dp_size,
        "max_total_num_tokens": info.get("max_total_tokens"),
        "version": __version__,
    }
    return {**info, **sglang, "server": public}


@router.get("/get_load")
def get_load(request: Request) -> list[dict]:
    """One entry per data-parallel rank: the engine, or each replica of a pool."""
    info = _engine(request).get_server_info()
    ranks = [r.get("info") for r in info["replicas"]] if "replicas" in info else [info]
    return [_load(rank, i) for i, rank in enumerate(ranks) if rank is not None]


def _load(info: dict, dp_rank: int) -> dict:
    return {
        "dp_rank": dp_rank,
        "num_reqs": info["num_running"] + info["num_waiting"],
        "num_running_reqs": info["num_running"],
        "num_waiting_reqs": info["num_waiting"],
        "num_tokens": info["kv_total"] - info["kv_free"],
    }


@router.get("/v1/loads")
def get_loads(request: Request, dp_rank: int | None = None) -> Any:
    """SGLang's load report: one entry per data-parallel rank (the engine, or each replica)."""
    info = _engine(request).get_server_info()
    ranks = [r.get("info") for r in info["replicas"]] if "replicas" in info else [info]
    if dp_rank is not None and not 0 <= dp_rank < len(ranks):
        return error(400, f"dp_rank must be in [0, {len(ranks)}), got {dp_rank}")
    return loads_report(ranks, dp_rank)


@router.post("/flush_cache")
@router.get("/flush_cache", operation_id="flush_cache_get")  # SGLang's clients use GET
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
    owners = request.app.state.owners
    if call.abort_all or owners.may_abort(call.rid, role):
        _engine(request).abort_request(rid=call.rid, abort_all=call.abort_all)
        if not call.abort_all:
            for member in owners.members(call.rid):  # an OpenAI stream's choices
                _engine(request).abort_request(rid=member)
    return JSON({"success": True})


@router.post("/open_session")
def open_session(body: OpenSessionBody, request: Request) -> JSON:
    """Opens a session for multi-turn token-in/token-out requests; answers its id (a JSON
    string, as SGLang does)."""
    return JSON(_engine(request).open_session(body.capacity_of_str_len, body.session_id))


@router.post("/close_session")
def close_session(body: CloseSessionBody, request: Request) -> Response:
    """Closes a session: its running turns are aborted, the KV it kept is unpinned."""
    _engine(request).close_session(body.session_id)
    return Response(status_code=200)


@router.get("/metrics")
def metrics(request: Request) -> Response:
    text = request.app.state.metrics.render(_engine(request).get_server_info())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
