"""POST /generate in `rollout router`, relayed: the client's body goes to a worker as it came,
and the worker's answer comes back as it went.

The router's app (rollout serve's, over the pool) would parse the body into a GenerateRequest,
validate it, send it again as new JSON, then parse the worker's answer and render it again, all
under FastAPI's middleware and routing: most of what the router added to a request (RESULTS.md,
issue 21). In front of that app, behind the same Guard (API keys, body limit, shutdown) and
CountErrors, GenerateRelay takes a one-prompt body (requests.relay_part) past all of it: the
body is parsed only for what routing needs, and the worker's bytes go back unchanged unless a
retry on another worker has to mark them. The worker checks the request; its refusal comes
back as the router's own would. Any other request goes on to the app as it came (the app's
Guard and CountErrors let it pass): a batch to split, a streamed batch or n > 1, a body over
LARGE_BODY_BYTES (parsed off the loop there), one the app refuses.

What the app's /generate does around the call, this does too: the rid's owner for
abort_request, the request aborted when its client leaves, the server's metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import nullcontext
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.responses import Response

from rollout.pool.dispatch import Dispatcher
from rollout.pool.requests import Part, relay_part
from rollout.server.guard import Guard
from rollout.server.json_body import LARGE_BODY_BYTES
from rollout.server.metrics import DISCONNECT_STATUS, TOKEN_COUNTS, CountErrors, ServerMetrics
from rollout.server.options import ServerOptions
from rollout.server.responses import describe_failure, failure
from rollout.server.streaming import ClientDisconnected, sse

T = TypeVar("T")
PATH = "/generate"
WATCH_AFTER_S = 0.02  # how late a client that left may be noticed (its request then aborted)
JSON_TYPE = (b"content-type", b"application/json")
# On a relayed one-prompt answer: the index (in --worker-urls) of the worker that gave it, for
# telling the router's own time from its workers' (benchmarks/bench_pool.py's probes).
REPLICA_HEADER = b"x-rollout-replica"
_COUNT_KEY = re.compile(rb'"(' + "|".join(TOKEN_COUNTS).encode() + rb')":\s*(\d+)')
# finish_reason: null, or an object whose first key is its type (rollout/engine/messages.py);
# either way one output, its type None where it is not found first.
_FINISH_KEY = re.compile(rb'"finish_reason":\s*(?:\{\s*"type":\s*"([^"\\]*)")?')
SSE_HEADERS = [  # what rollout serve's streams (streaming.sse_response) are sent with
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def relay_front(app: FastAPI, dispatcher: Dispatcher, options: ServerOptions) -> Any:
    """The ASGI app `rollout router` serves: `app` (rollout serve's, over a pool of HTTP
    workers) with /generate relayed, behind a Guard and a CountErrors of its own."""
    relay = GenerateRelay(app, dispatcher, app.state)
    return CountErrors(Guard(relay, options=options, state=app.state), app.state.metrics)


class GenerateRelay:
    def __init__(self, app: Any, dispatcher: Dispatcher, state: Any) -> None:
        """`app`: what serves every other request; `state`: its state (metrics, owners)."""
        self.app = app
        self.dispatcher = dispatcher
        self.metrics: ServerMetrics = state.metrics
        self.owners = state.owners

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if not _relayable(scope):
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        try:
            fields = json.loads(body)
        except (ValueError, RecursionError):  # the app answers it
            fields = None
        part = relay_part(fields, body)
        if part is None:
            await self.app(scope, _replay(body, receive), send)
            return
        rid, log_metrics = fields.get("rid"), fields.get("log_metrics", True)
        role = scope["state"]["role"]
        with self.owners.claim(rid, role) if rid is not None else nullcontext():
            if fields.get("stream", False):
                await self._stream(scope, receive, send, part, log_metrics)
            else:
                await self._answer(scope, receive, send, part, log_metrics)

    async def _answer(
        self, scope: dict, receive: Any, send: Any, part: Part, log_metrics: bool
    ) -> None:
        start = time.monotonic()
        try:
            answer, replica = await until_disconnect(receive, self.dispatcher.relay(part))
        except Exception as e:  # noqa: BLE001 - answered as the app's handlers answer it
            await _refusal(e, scope, receive, send)
            return
        length = (b"content-length", str(len(answer)).encode())
        headers = [JSON_TYPE, length, (REPLICA_HEADER, str(replica).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": answer})
        if log_metrics:  # once the answer is out, which waits on nothing here
            observe_answer(self.metrics, answer, start)

    async def _stream(
        self, scope: dict, receive: Any, send: Any, part: Part, log_metrics: bool
    ) -> None:
        start = time.monotonic()
        events = self.dispatcher.relay_stream(part)
        try:
            # Awaited before the 200 goes out: a refusal is a plain error answer.
            first = await events.__anext__()
        except Exception as e:  # noqa: BLE001 - answered as the app's handlers answer it
            await events.aclose()
            await _refusal(e, scope, receive, send)
            return
        if log_metrics:
            self.metrics.ttft.observe(time.monotonic() - start)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        try:
            last = await until_disconnect(receive, self._pump(first, events, send))
        except ClientDisconnected:
            self.metrics.disconnected(PATH)
            return
        finally:
            await events.aclose()  # a stream left early: its worker aborts the request
        await send({"type": "http.response.body", "body": b""})
        if log_metrics and last is not None:
            self.metrics.observe("generate", [last], time.monotonic() - start)

    async def _pump(self, first: bytes, events: AsyncIterator[bytes], send: Any) -> dict | None:
        """Sends the events on, `first` first. The last output, or None when the stream failed:
        an error event and `[DONE]` then end it, as they end the app's streams."""
        last = first
        try:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in events:
                if not chunk.startswith(b"data: [DONE]"):
                    last = chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as e:  # noqa: BLE001 - the 200 is sent: the error goes in the stream
            status, message, kind = describe_failure(e, PATH)
            self.metrics.error(PATH, status, kind)
            error = {"error": {"message": message, "type": kind, "code": status}}
            ending = (sse(error) + sse("[DONE]")).encode()
            await send({"type": "http.response.body", "body": ending, "more_body": True})
            return None
        return _last_output(last)


async def until_disconnect(receive: Any, work: Awaitable[T]) -> T:
    """`work`, awaited in this task, which is cancelled if the client disconnects first (its
    request is then aborted on its worker): ClientDisconnected is raised once that has run.
    The client is watched from WATCH_AFTER_S on: a quicker answer costs no task (as
    streaming.until_disconnect's, which also runs `work` as a task of its own)."""
    task = asyncio.current_task()
    assert task is not None
    waiting, left = True, False
    watcher: asyncio.Future | None = None

    def on_message(done: asyncio.Future) -> None:
        nonlocal left
        # NOTE: a done callback runs a turn after the watcher ends: `work` may be done by then.
        if waiting and not done.cancelled() and done.result()["type"] == "http.disconnect":
            left = True
            task.cancel()

    def watch() -> None:
        nonlocal watcher
        watcher = asyncio.ensure_future(receive())  # after the body: http.disconnect, or none
        watcher.add_done_callback(on_message)

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
    try:
        return await work
    except asyncio.CancelledError:
        if not left:
            raise
        if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation ends here
            task.uncancel()
        raise ClientDisconnected("the client disconnected before its answer was ready") from None
    finally:
        waiting = False
        timer.cancel()
        if watcher is not None:
            watcher.cancel()


def observe_answer(metrics: ServerMetrics, answer: bytes, start: float) -> None:
    """Records a relayed /generate's JSON answer, begun at `start` (time.monotonic), from what
    its bytes say of each output: a finish reason's type and the token counts. Not parsed:
    json.loads of an answer with logprobs holds the router's loop for milliseconds, and a key
    in its quotes cannot occur inside a JSON string (a quote there is escaped), so each match
    is a key of an output's meta_info as the worker wrote it."""
    reasons = [
        match.group(1).decode() if match.group(1) is not None else "unknown"
        for match in _FINISH_KEY.finditer(answer)
    ]
    tokens = dict.fromkeys(TOKEN_COUNTS, 0)
    for match in _COUNT_KEY.finditer(answer):
        tokens[match.group(1).decode()] += int(match.group(2))
    metrics.observe_counts("generate", reasons, tokens, time.monotonic() - start)


def _relayable(scope: dict) -> bool:
    """A POST /generate whose body, of a stated length, is small enough to read here."""
    if scope["type"] != "http" or scope["path"] != PATH or scope["method"] != "POST":
        return False
    for name, value in scope["headers"]:
        if name == b"content-length":
            return value.isdigit() and int(value) <= LARGE_BODY_BYTES
    return False


def _last_output(events: bytes) -> dict | None:
    """The last output of a stream whose events ended with `events`."""
    for line in reversed(events.split(b"\n")):
        if line.startswith(b"data:") and (data := line[5:].strip()) != b"[DONE]":
            return json.loads(data)
    return None


async def _refusal(error: Exception, scope: dict, receive: Any, send: Any) -> None:
    """The app's answer to `error` raised by its /generate (its exception handlers')."""
    if isinstance(error, ClientDisconnected):
        response = Response(status_code=DISCONNECT_STATUS)  # nobody reads it; /metrics counts it
    else:
        response = failure(error, PATH)
    await response(scope, receive, send)


async def _read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """`receive` for the app, the body already read: it first, then what `receive` gives."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed
