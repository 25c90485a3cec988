"""HttpReplica against a stand-in worker (aiohttp.web, no engine): how a worker's answers, errors
and disappearance reach the pool."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from rollout.engine.tokenizer_manager import RequestFailedError
from rollout.errors import Forbidden, InvalidRequest
from rollout.generate_request import GenerateRequest
from rollout.pool.http_replica import HttpReplica
from rollout.pool.replica import ReplicaDead

REQUEST = GenerateRequest.from_json({"input_ids": [1, 2, 3], "sampling_params": {"n": 1}})
LONG_TEXT = "x" * 300_000  # one SSE line longer than aiohttp's line buffer


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "t", "code": status}}
    return web.json_response(body, status=status)


async def _generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    sent = {"auth": request.headers.get("Authorization"), "body": body}
    status = body.get("rid")  # the test picks the worker's answer by rid
    if status in ("400", "401", "500", "503"):
        return _error(int(status), f"refused with {status}")
    if not body.get("stream"):
        return web.json_response({"text": "ok", "meta_info": {"sent": sent}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = [{"text": "a", "meta_info": {}}, {"text": LONG_TEXT, "meta_info": {}}]
    if status == "midstream-error":
        events.append({"error": {"message": "the engine failed", "code": 500}})
    for event in events:
        await resp.write(f"data: {json.dumps(event)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    return resp


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@pytest.fixture
def worker_url():
    """A stand-in worker on a free port, served on a loop of its own thread."""
    app = web.Application()
    app.router.add_post("/generate", _generate)
    app.router.add_get("/health", _health)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port bound
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _run(url: str, work) -> object:
    async def main():
        replica = HttpReplica(0, url, api_key="k")
        try:
            return await work(replica)
        finally:
            await replica.stop()

    return asyncio.run(main())


def test_an_answer_comes_back_as_json_with_the_key_sent(worker_url):
    answer = _run(worker_url, lambda r: r.generate(REQUEST))
    assert answer["text"] == "ok"
    assert answer["meta_info"]["sent"] == {"auth": "Bearer k", "body": REQUEST.to_json()}


@pytest.mark.parametrize(
    "status, error",
    [("400", InvalidRequest), ("401", Forbidden), ("500", RequestFailedError),
     ("503", ReplicaDead)],
)  # fmt: skip
def test_a_worker_error_is_the_engine_exception_of_its_status(worker_url, status, error):
    request = GenerateRequest.from_json({**REQUEST.to_json(), "rid": status})
    with pytest.raises(error, match=f"refused with {status}"):
        _run(worker_url, lambda r: r.generate(request))


def test_a_stream_passes_events_longer_than_a_read_buffer(worker_url):
    request = GenerateRequest.from_json({**REQUEST.to_json(), "stream": True})

    async def collect(replica):
        return [item async for item in replica.stream(request)]

    items = _run(worker_url, collect)
    assert [item["text"] for item in items] == ["a", LONG_TEXT]


def test_an_error_event_in_a_stream_is_raised(worker_url):
    body = {**REQUEST.to_json(), "stream": True, "rid": "midstream-error"}
    request = GenerateRequest.from_json(body)

    async def collect(replica):
        return [item async for item in replica.stream(request)]

    with pytest.raises(RequestFailedError, match="the engine failed"):
        _run(worker_url, collect)


def test_an_unreachable_worker_is_dead_and_not_alive():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        with pytest.raises(ReplicaDead, match="unreachable"):
            _run(url, lambda r: r.generate(REQUEST))
        assert _run(url, lambda r: r.alive()) is False
