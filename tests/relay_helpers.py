"""Stand-in `rollout serve` workers (aiohttp.web, no engine) for the tests of `rollout router`'s
relay of /generate: each answers by its state and the request's rid and records what it got."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

from aiohttp import web

from rollout.pool.dispatch import Dispatcher
from rollout.pool.http_replica import HttpReplica
from rollout.pool.router import Router
from rollout.pool.supervisor import Supervisor
from rollout.server.app import create_app
from rollout.server.options import ServerOptions

WORKER_KEY, USER_KEY = "worker-key", "user-key"
USER_HEADERS = {"Authorization": f"Bearer {USER_KEY}", "Content-Type": "application/json"}
# Formatted as no JSON library of the router's would write it: spaces, an escape, -Infinity.
ANSWER = b'{"text": "caf\\u00e9 \xc3\xa9",  "output_ids":[7],\n "meta_info": {"id": "w", "x": -Infinity}}'
EVENTS = [b'data: {"text": "a", "meta_info": {"id": "w"}}\n\n',
          b'data: {"text": "ab", "meta_info": {"id": "w"}}\n\n']  # fmt: skip


class StandInWorker:
    """A worker that answers /generate by its state and the request's rid, and records each
    body it got; its /health and /get_server_info answer as a worker's do."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.auth: list[str | None] = []
        self.dead = False
        self.left: list[bytes] = []  # bodies of held requests whose client left

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        if self.dead:
            return _error(503, "the engine is not serving")
        fields = json.loads(body)
        rid = fields.get("rid")
        if rid == "hold":  # answered when the client leaves, which is recorded
            while request.transport is not None and not request.transport.is_closing():
                await asyncio.sleep(0.01)
            self.left.append(body)
            return _error(500, "the client left")
        if rid in ("400", "401", "500"):
            return _error(int(rid), f"refused with {rid}")
        if not fields.get("stream"):
            if isinstance(fields.get("input_ids", [0])[0], list):  # a part of a split batch
                return web.json_response([{"output_ids": fields["input_ids"][0], "meta_info": {}}])
            return web.Response(body=ANSWER, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in EVENTS:
            await resp.write(event)
        if rid == "midstream-error":
            await resp.write(b'data: {"error": {"message": "the engine failed", "code": 500}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1})


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "t", "code": status}}
    return web.json_response(body, status=status)


@contextlib.contextmanager
def stand_in_workers() -> Iterator[list[StandInWorker]]:
    """Two stand-in workers, each on a free port, served on a loop of its own thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    made, runners = [], []
    for _ in range(2):
        worker = StandInWorker()
        app = web.Application()
        app.router.add_post("/generate", worker.generate)
        app.router.add_get("/health", worker.health)
        app.router.add_get("/get_server_info", worker.server_info)
        runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(runner.setup(), loop).result(10)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        asyncio.run_coroutine_threadsafe(site.start(), loop).result(10)
        port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001 - the port bound
        worker.url = f"http://127.0.0.1:{port}"
        made.append(worker)
        runners.append(runner)
    try:
        yield made
    finally:
        for runner in runners:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


class StandInPool:
    """What the router's app needs of its RolloutPool here (the app's own /generate path)."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    async def async_generate(self, request):
        return await self.dispatcher.generate(request)

    def is_alive(self) -> bool:
        return True


@contextlib.asynccontextmanager
async def router_app(workers: list[StandInWorker]):
    """(app, dispatcher, options) of a router over `workers`, as `rollout router` makes them
    (its users' key USER_KEY, the workers' WORKER_KEY), on the running loop."""
    replicas = [HttpReplica(i, w.url, api_key=WORKER_KEY) for i, w in enumerate(workers)]
    routing = Router(len(replicas))
    supervisor = Supervisor(replicas, routing, health_check_s=0)
    await supervisor.start_all()
    dispatcher = Dispatcher(supervisor, routing, wait_s=0.5)
    options = ServerOptions(api_key=USER_KEY, served_model_name="m")
    try:
        yield create_app(StandInPool(dispatcher), options), dispatcher, options
    finally:
        await supervisor.stop()
