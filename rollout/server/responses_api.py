"""/v1/responses (OpenAI's Responses API) over the chat pipeline.

A request's items (after the stored conversation of its previous_response_id) become chat
messages, and the chat route serves them: the chat template, --tool-call-parser and
--reasoning-parser, tool_choice and response_format grammars, sampling. Its answer, whole or
streamed, is re-shaped here into output items (reasoning, message, function_call) and the
Responses stream's events. Models whose chat format is Harmony are rendered and parsed by
openai-harmony instead (see harmony_api).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from rollout.engine.request_limits import RequestLimits
from rollout.errors import InvalidRequest
from rollout.server import harmony_api
from rollout.server.json_body import OffLoopRoute, describe_validation_errors
from rollout.server.openai_api import chat_completions
from rollout.server.openai_protocol import ChatCompletionRequest
from rollout.server.responses import check_model, error, json_response
from rollout.server.responses_output import (
    OutputBuilder,
    feed_chat,
    final_status,
    new_id,
    response_object,
    responses_usage,
    stored_items,
)
from rollout.server.responses_protocol import ResponsesRequest, chat_messages, check_items
from rollout.server.responses_store import ResponseStore, app_store, stored
from rollout.server.responses_stream import EventStream

router = APIRouter(route_class=OffLoopRoute)


def response_store(request: Request) -> ResponseStore:
    return app_store(request.app.state)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    if (bad := check_model(request, body.model)) is not None:
        return bad
    engine = request.app.state.engine
    await engine.run_in_worker(body.check_unicode)  # every string of the input: off the loop
    store = response_store(request)
    items = body.input_items()
    check_items(items)
    conversation = store.conversation(body.previous_response_id) + items
    if harmony_api.is_harmony_model(engine.tokenizer):
        return await harmony_api.create_response(body, conversation, request)
    chat = await engine.run_in_worker(_chat_request, body, conversation, engine.limits)
    answer = await chat_completions(chat, request)
    if answer.status_code != 200:
        return answer  # an error, already in the API's shape
    rid = new_id("resp")
    if not body.stream:
        return await json_response(_whole(rid, body, conversation, answer, store))
    stream = EventStream(rid, body, conversation, store)
    return stream.response(_chat_parts(answer.body_iterator))


@router.get("/v1/responses/{response_id}")
def get_response(response_id: str, request: Request) -> Any:
    stored = response_store(request).get(response_id)
    if stored is None:
        return error(404, f"response {response_id!r} is not stored here", "not_found_error")
    return stored.response


@router.delete("/v1/responses/{response_id}")
def delete_response(response_id: str, request: Request) -> Any:
    if not response_store(request).delete(response_id):
        return error(404, f"response {response_id!r} is not stored here", "not_found_error")
    return {"id": response_id, "object": "response", "deleted": True}


def _chat_request(
    body: ResponsesRequest, conversation: list[dict], limits: RequestLimits
) -> ChatCompletionRequest:
    """The chat request that serves `body`. What the chat route would refuse naming its own
    fields (response_format, messages) is refused here naming the Responses API's."""
    tools = body.chat_tools()
    body.check_text_format()
    messages = chat_messages(conversation, body.instructions)
    limits.check_text(messages, "the input (with the instructions and earlier turns)")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "stop": body.stop,
        "rid": body.rid,
        "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": body.response_format(),
    }
    # Without tools, a tool_choice that needs one goes too: the chat route refuses it.
    if tools or body.tool_choice != "auto":
        fields.update(tools=tools, tool_choice=body.chat_tool_choice())
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    try:
        chat = ChatCompletionRequest(**fields)
    except ValidationError as e:  # what the items make doesn't fit a chat message
        raise InvalidRequest(describe_validation_errors(list(e.errors()))) from e
    chat.rename("max_new_tokens", "max_output_tokens")
    return chat


def _whole(
    rid: str, body: ResponsesRequest, conversation: list[dict], answer: Any, store: ResponseStore
) -> dict:
    chat = json.loads(answer.body)
    choice = chat["choices"][0]
    message = choice["message"]
    builder = OutputBuilder()
    feed_chat(builder, message)
    builder.close()
    status, incomplete = final_status(choice["finish_reason"])
    usage = responses_usage(chat.get("usage"))
    response = response_object(rid, body, builder.items, status, usage, incomplete)
    weight_version = (chat.get("metadata") or {}).get("weight_version")
    if weight_version is not None:
        response["weight_version"] = weight_version  # which policy wrote it, for RL
    if body.store:
        store.put(stored(response, conversation + stored_items(builder.items), body.input))
    return response


async def _chat_parts(events: AsyncIterator[Any]) -> AsyncIterator[dict]:
    """The chat stream's chunks as dicts: {"delta", "finish_reason"}, {"usage"}, {"error"}."""
    try:
        async for raw in events:
            text = raw.decode() if isinstance(raw, bytes) else raw
            for line in text.splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    yield {"error": chunk["error"]}
                elif chunk.get("usage") is not None and not chunk.get("choices"):
                    yield {"usage": chunk["usage"]}
                for choice in chunk.get("choices") or ():
                    yield {"delta": choice["delta"], "finish_reason": choice["finish_reason"]}
    finally:
        await events.aclose()  # type: ignore[attr-defined]  # aborts the engine's request
