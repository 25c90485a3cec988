"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (/v1/models: models_api.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from rollout.control import is_int
from rollout.engine.chat_template import chat_ids
from rollout.engine.request_validation import encode_prompt
from rollout.engine.token_text import TokenText
from rollout.errors import InvalidRequest, InvalidRequestType, RequestError
from rollout.server import chat_output
from rollout.server.json_body import OffLoopRoute
from rollout.server.openai_format import (
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    join_logprobs,
    matched_stop,
    prompt_logprobs,
    usage,
    version_metadata,
)
from rollout.server.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from rollout.server.responses import check_model, is_large, json_response, model_adapter
from rollout.server.stream_fanout import first_outputs
from rollout.server.streaming import (
    error_event,
    gather_streams,
    sse,
    sse_response,
    until_disconnect,
)

if TYPE_CHECKING:
    from rollout.engine.engine import RolloutEngine
    from rollout.server.responses_protocol import ResponsesRequest

router = APIRouter(route_class=OffLoopRoute)

PROMPT_TAIL_TOKENS = 8  # large bodies parsed off the event loop

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's default


# The two below tokenize and render templates: they run on the engine's worker threads
# (engine.run_in_worker), never on the server's event loop.
def _prompts(body: CompletionRequest, engine: RolloutEngine) -> tuple[list[list[int]], list[str]]:
    """The prompts' ids, and the text each echoes (empty without echo)."""
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    if not isinstance(p, list):
        raise InvalidRequestType("prompt must be a string, a list of strings or token ids")
    if not p:
        raise InvalidRequest("prompt is empty")
    if all(is_int(x) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    else:
        for x in p:
            if not isinstance(x, str) and not (isinstance(x, list) and all(is_int(t) for t in x)):
                raise InvalidRequestType(
                    "prompt must be a string, a list of strings, a list of token ids, or a list "
                    "of such lists"
                )
        tok, limits = engine.tokenizer, engine.limits
        prompts = [
            encode_prompt(tok, limits, x, f"prompt {i}") if isinstance(x, str) else list(x)
            for i, x in enumerate(p)  # type: ignore[union-attr]
        ]
    echo = [engine.tokenizer.decode(ids) if body.echo else "" for ids in prompts]
    return prompts, echo


def _chat_prompt(body: ChatCompletionRequest, engine: RolloutEngine) -> tuple[list[int], str]:
    """The prompt's ids, and the text of its last few tokens (where a reasoning parser looks
    for a thinking tag the template opened)."""
    messages = [m.as_template_input() for m in body.messages]
    ids = chat_ids(
        engine.tokenizer,
        engine.limits,
        messages,
        add_generation_prompt=not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
        tools=body.tools if body.tool_names() else None,
    )
    return ids, engine.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:])


@contextmanager
def named_as(body: SamplingFields | ResponsesRequest) -> Iterator[None]:
    """Raises the engine's refusals of `body` with its fields named as the client sent them
    (max_tokens where the engine says max_new_tokens)."""
    try:
        yield
    except RequestError as e:
        message = body.as_named(str(e))
        if message == str(e):
            raise
        raise type(e)(message) from None


async def _run(
    request: Request,
    endpoint: str,
    body: SamplingFields,
    prompts: list[list[int]],
    max_new: int,
    top: int | None,
    build: Any,
    logprob_start_len: int | None = None,
) -> Any:
    """Non-streamed: one engine call for every prompt x n; `build(outputs)` makes the response."""
    engine = request.app.state.engine
    start = time.monotonic()
    with request.app.state.owners.claim(body.rid, request.state.role), named_as(body):
        outputs = await until_disconnect(
            request,
            engine.async_generate(
                input_ids=prompts,
                sampling_params=body.sampling_params(max_new),
                return_logprob=top is not None,
                top_logprobs_num=top or 0,
                logprob_start_len=logprob_start_len,
                rid=body.rid,
                lora_path=model_adapter(request, body.model),
            ),
        )
    request.app.state.metrics.observe(endpoint, outputs, time.monotonic() - start)
    if is_large(outputs):  # a million logprob entries take seconds of Python to build
        return await json_response(await asyncio.to_thread(build, outputs))
    return await json_response(build(outputs))


async def _open_streams(
    request: Request,
    body: SamplingFields,
    prompts: list[list[int]],
    max_new: int,
    top: int | None,
    logprob_start_len: int | None = None,
) -> list[AsyncIterator[dict]]:
    """One engine stream per prompt x sample (seeds as the non-streamed call would give them);
    each is started and its first output awaited, so bad input fails before the 200."""
    engine = request.app.state.engine
    params = body.sampling_params(max_new)
    lora = model_adapter(request, body.model)
    # As one request: n and the response's size are bounded over all the streams together.
    with named_as(body):
        await engine.run_in_worker(
            engine.validate_generate, input_ids=prompts, sampling_params=params,
            return_logprob=top is not None, top_logprobs_num=top or 0, rid=body.rid,
            logprob_start_len=logprob_start_len, lora_path=lora,
        )  # fmt: skip
    # Each choice streams as a request of its own: with a rid, "rid-0", "rid-1", ... (the
    # engine's names for n samples), claimed as the group "rid" that abort_request ends.
    count = len(prompts) * body.n
    rids = (
        [body.rid]
        if count == 1
        else [None if body.rid is None else f"{body.rid}-{k}" for k in range(count)]
    )
    group = body.rid if count > 1 else None
    owners, role = request.app.state.owners, request.state.role
    streams = []
    for k, ids in enumerate(ids for ids in prompts for _ in range(body.n)):
        j = k % body.n
        p = {**params, "n": 1, "seed": None if body.seed is None else body.seed + j}
        opened = engine.async_generate(
            input_ids=ids,
            sampling_params=p,
            return_logprob=top is not None,
            top_logprobs_num=top or 0,
            logprob_start_len=logprob_start_len,
            stream=True,
            lora_path=lora,
            rid=rids[k],
        )
        streams.append(owners.stream(opened, rids[k], role, group))
    return await until_disconnect(request, first_outputs(streams))


def _stream(
    request: Request,
    endpoint: str,
    streams: list[AsyncIterator[dict]],
    body: SamplingFields,
    chunk: Any,
) -> Any:
    """SSE over merged choice streams. `chunk(index, out, state)` returns the events for one
    update of choice `index`; `state` is that choice's dict of what was sent so far."""
    metrics = request.app.state.metrics
    start = time.monotonic()
    states: list[dict] = [{"text": 0, "logprobs": 0, "first": True, "last": None} for _ in streams]
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def on_item(i: int, out: dict) -> list[str]:
        states[i]["last"] = out
        return chunk(i, out, states[i])

    async def events() -> AsyncIterator[str]:
        try:
            async for event in gather_streams(streams, on_item):
                yield event
        except (ValueError, RuntimeError) as e:
            yield error_event(e, request)
            yield sse("[DONE]")
            return
        outs = [s["last"] for s in states]
        metrics.observe(endpoint, outs, time.monotonic() - start)
        if include_usage:
            yield sse({**chunk(None, None, None)[0], "choices": [], "usage": usage(outs, body.n)})
        yield sse("[DONE]")

    metrics.ttft.observe(time.monotonic() - start)
    return sse_response(events(), request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    if (bad := check_model(request, body.model)) is not None:
        return bad
    engine = request.app.state.engine
    # echo with logprobs: the prompt's logprobs too, from its first token on.
    echo_logprobs = body.echo and body.logprobs is not None
    start = 0 if echo_logprobs else None
    prompts, echo = await engine.run_in_worker(_prompts, body, engine)
    max_new = body.max_tokens if body.max_tokens is not None else COMPLETIONS_DEFAULT_MAX_TOKENS
    text_of = TokenText(engine.tokenizer)
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": body.model}

    if not body.stream:

        def build(outputs: list[dict]) -> dict:
            choices = []
            for i, out in enumerate(outputs):
                meta = out["meta_info"]
                logprobs = None
                if body.logprobs is not None:
                    logprobs, _ = completion_logprobs(meta, text_of, 0, len(echo[i // body.n]))
                if echo_logprobs:
                    logprobs = join_logprobs(prompt_logprobs(meta, text_of), logprobs)
                choices.append(
                    {
                        "index": i,
                        "text": echo[i // body.n] + out["text"],
                        "logprobs": logprobs,
                        "finish_reason": finish_reason(meta),
                        "matched_stop": matched_stop(meta),
                    }
                )
            return {
                **head,
                "choices": choices,
                "usage": usage(outputs, body.n),
                "metadata": version_metadata(outputs[0]["meta_info"]),
            }

        return await _run(
            request, "v1/completions", body, prompts, max_new, body.logprobs, build, start
        )

    def chunk(i: int | None, out: dict | None, st: dict | None) -> list[str]:
        if out is None or st is None or i is None:
            return [head]  # type: ignore[list-item]
        meta = out["meta_info"]
        text = out["text"][st["text"] :]
        reason = finish_reason(meta)
        if not text and reason is None:
            return []  # nothing to show yet (e.g. half a character): its logprobs go out next time
        first, shift = st["first"], len(echo[i // body.n])
        if first:
            text, st["first"] = echo[i // body.n] + text, False
        logprobs = None
        if body.logprobs is not None:
            offset = st.get("offset", shift)
            logprobs, st["offset"] = completion_logprobs(meta, text_of, st["logprobs"], offset)
            st["logprobs"] = len(meta.get("output_token_logprobs", []))
            if first and echo_logprobs:
                logprobs = join_logprobs(prompt_logprobs(meta, text_of), logprobs)
        st["text"] = len(out["text"])
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:
            choice["matched_stop"] = matched_stop(meta)
        return [sse({**head, "choices": [choice]})]

    streams = await _open_streams(request, body, prompts, max_new, body.logprobs, start)
    return _stream(request, "v1/completions", streams, body, chunk)


async def _chat_setup(
    body: ChatCompletionRequest, request: Request
) -> tuple[ChatCompletionRequest, list[int], Any, int]:
    """The chat request as it runs (tool-call and reasoning grammars applied), its prompt ids,
    the output parsers, and its max_new_tokens."""
    engine, options = request.app.state.engine, request.app.state.options
    chat_output.check_tool_choice(body, options)
    body = chat_output.force_tool_calls(body, options)
    ids, tail = await engine.run_in_worker(_chat_prompt, body, engine)
    parsers = chat_output.output_parsers(body, options, tail)
    body = chat_output.grammar_after_reasoning(body, options, tail)
    if chat_output.needs_special_tokens(body, options):
        body = body.model_copy(update={"skip_special_tokens": False})
    limit = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    return body, ids, parsers, limit if limit is not None else engine.info["context_length"]


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    if (bad := check_model(request, body.model)) is not None:
        return bad
    body, ids, parsers, max_new = await _chat_setup(body, request)
    prompts = [ids]
    top = (body.top_logprobs or 0) if body.logprobs else None
    text_of = TokenText(request.app.state.engine.tokenizer)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": body.model}

    if not body.stream:

        def build(outputs: list[dict]) -> dict:
            choices = []
            for i, out in enumerate(outputs):
                meta = out["meta_info"]
                message, reason = chat_output.message(
                    out["text"], finish_reason(meta), parsers, body.parallel_tool_calls
                )
                choices.append(
                    {
                        "index": i,
                        "message": message,
                        "logprobs": chat_logprobs(meta, text_of, 0) if body.logprobs else None,
                        "finish_reason": reason,
                        "matched_stop": matched_stop(meta),
                    }
                )
            return {
                **head,
                "object": "chat.completion",
                "choices": choices,
                "usage": usage(outputs, body.n),
                "metadata": version_metadata(outputs[0]["meta_info"]),
            }

        return await _run(request, "v1/chat/completions", body, prompts, max_new, top, build)

    chunk_head = {**head, "object": "chat.completion.chunk"}

    def chunk(i: int | None, out: dict | None, st: dict | None) -> list[str]:
        if out is None or st is None or i is None:
            return [chunk_head]  # type: ignore[list-item]
        events = []
        if st["first"]:
            st["first"] = False
            delta = {"role": "assistant", "content": ""}
            events.append(
                sse(
                    {
                        **chunk_head,
                        "choices": [
                            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                        ],
                    }
                )
            )
        meta = out["meta_info"]
        text = out["text"][st["text"] :]
        reason = finish_reason(meta)
        if text or reason is not None:
            st["text"] = len(out["text"])
            logprobs = None
            if body.logprobs:
                logprobs = chat_logprobs(meta, text_of, st["logprobs"])
                st["logprobs"] = len(meta.get("output_token_logprobs", []))
            delta, reason = chat_output.delta(text, reason, st, parsers, body.parallel_tool_calls)
            choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            if reason is not None:
                choice["matched_stop"] = matched_stop(meta)
            events.append(sse({**chunk_head, "choices": [choice]}))
        return events

    streams = await _open_streams(request, body, prompts, max_new, top)
    return _stream(request, "v1/chat/completions", streams, body, chunk)
