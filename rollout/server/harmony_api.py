"""/v1/responses for models whose chat format is Harmony (gpt-oss): the conversation is
rendered by openai-harmony, the engine generates from its ids, and the output ids are parsed
back into reasoning, message and function_call items (see harmony.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from rollout.server import harmony
from rollout.server.openai_api import named_as
from rollout.server.responses import error, json_response, model_adapter
from rollout.server.responses_output import (
    OutputBuilder,
    feed_chat,
    final_status,
    new_id,
    response_object,
    responses_usage,
    stored_items,
)
from rollout.server.responses_protocol import ResponsesRequest
from rollout.server.responses_store import app_store, stored
from rollout.server.responses_stream import EventStream
from rollout.server.streaming import until_disconnect

is_harmony_model = harmony.is_harmony_template


async def create_response(
    body: ResponsesRequest, conversation: list[dict[str, Any]], request: Request
) -> Any:
    """The Responses answer, whole or streamed, of a checked request to a Harmony model."""
    engine = request.app.state.engine
    try:
        await engine.run_in_worker(harmony.encoding)  # loads (or downloads) it the first time
    except harmony.HarmonyUnavailable as e:
        return error(501, str(e), "server_error")
    harmony.check_request(body)
    ids = await engine.run_in_worker(harmony.render, body, conversation)
    kwargs = {
        "input_ids": ids,
        "sampling_params": _sampling_params(body, engine.info["context_length"]),
        "rid": body.rid,
        "lora_path": model_adapter(request, body.model),
    }
    rid, store = new_id("resp"), app_store(request.app.state)
    if body.stream:
        with named_as(body):
            await engine.run_in_worker(engine.validate_generate, **kwargs)
        outputs = await engine.async_generate(stream=True, **kwargs)
        return EventStream(rid, body, conversation, store).response(_parts(outputs))
    start = time.monotonic()
    with request.app.state.owners.claim(body.rid, request.state.role), named_as(body):
        out = await until_disconnect(request, engine.async_generate(**kwargs))
    out = out[0] if isinstance(out, list) else out
    request.app.state.metrics.observe("v1/responses", [out], time.monotonic() - start)
    parser = harmony.HarmonyOutputParser()
    builder = OutputBuilder()
    feed_chat(builder, parser.feed(list(out["output_ids"])))
    feed_chat(builder, parser.finish())
    builder.close()
    meta = out["meta_info"]
    status, incomplete = final_status(_finish(meta))
    usage = responses_usage(_usage(meta))
    response = response_object(rid, body, builder.items, status, usage, incomplete)
    if meta.get("weight_version") is not None:
        response["weight_version"] = meta["weight_version"]
    if body.store:
        store.put(stored(response, conversation + stored_items(builder.items), body.input))
    return await json_response(response)


def _sampling_params(body: ResponsesRequest, context_length: int) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": body.max_output_tokens or context_length,
        "stop": body.stop,
        "stop_token_ids": harmony.stop_token_ids(),
        "skip_special_tokens": False,
        "seed": body.seed,
    }
    optional = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                "min_p": body.min_p}  # fmt: skip
    params.update({k: v for k, v in optional.items() if v is not None})
    return params


def _finish(meta: dict[str, Any]) -> str | None:
    reason = meta.get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else reason


def _usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)},
    }


async def _parts(outputs: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """The engine's stream (cumulative outputs) as EventStream's chat-shaped parts."""
    parser, seen, last = harmony.HarmonyOutputParser(), 0, None
    try:
        async for out in outputs:
            last = out
            ids = list(out["output_ids"])
            delta, seen = parser.feed(ids[seen:]), len(ids)
            yield {"delta": delta, "finish_reason": None}
    except (ValueError, RuntimeError) as e:
        from rollout.server.responses import describe_failure

        status, message, kind = describe_failure(e, "/v1/responses")
        yield {"error": {"message": message, "type": kind, "code": status}}
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]  # aborts the engine's request
    yield {"delta": parser.finish(), "finish_reason": _finish(last["meta_info"]) if last else None}
    if last is not None:
        yield {"usage": _usage(last["meta_info"])}
