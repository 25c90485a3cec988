"""`rollout router`'s connections (rollout/pool/relay_connection.py), served by uvicorn as the
router serves them, over stand-in workers and raw sockets: a one-prompt /generate is answered
on the connection, the connection kept, requests split over writes or sent back to back read
whole and in order; whatever the fast path does not take (a wrong key, a stream, a batch, a
bad body, a chunked or too large body) gets the app's answer, from its first byte; a refusal
is answered and counted as the app does; a client that leaves aborts its request on the
worker; a shutdown closes idle connections at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest
import uvicorn
from relay_helpers import ANSWER, EVENTS, USER_KEY, WORKER_KEY, router_app, stand_in_workers

from rollout.pool.generate_relay import relay_front
from rollout.pool.relay_connection import RelaySetup
from rollout.server.metrics import CLIENT_DISCONNECT

TIMEOUT_S = 10


@pytest.fixture
def workers():
    with stand_in_workers() as made:
        yield made


class Served:
    """A router over the workers, served by uvicorn on a loop of its own thread: its port,
    its app's metrics and routing, the paths that reached the ASGI app (not the fast path)."""

    def __init__(self, workers) -> None:
        self.workers = workers
        self.app_paths: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stack = contextlib.AsyncExitStack()

    def start(self) -> None:
        self.thread.start()
        self.call(self._start())

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT_S)

    async def _start(self) -> None:
        app, dispatcher, options = await self.stack.enter_async_context(router_app(self.workers))
        front = relay_front(app, dispatcher, options)

        async def counted(scope, receive, send):
            if scope["type"] == "http":
                self.app_paths.append(scope["path"])
            await front(scope, receive, send)

        protocol = RelaySetup(dispatcher, app.state, options).protocol()
        config = uvicorn.Config(counted, http=protocol, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.serving = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            await asyncio.sleep(0.01)
        self.metrics, self.routing = app.state.metrics, dispatcher.router

    async def _shutdown(self) -> float:
        start = time.monotonic()
        self.server.should_exit = True
        await self.serving
        return time.monotonic() - start

    def stop(self) -> float:
        """Shuts the server down (once); the seconds it took."""
        if not self.thread.is_alive():
            return 0.0
        took = self.call(self._shutdown())
        self.call(self.stack.aclose())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        self.sock.close()
        return took

    def connect(self) -> tuple[socket.socket, object]:
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT_S)
        return conn, conn.makefile("rb")

    def count(self, metric, **labels) -> float:
        for family in metric.collect():
            for sample in family.samples:
                if sample.name.endswith("_total") and labels.items() <= sample.labels.items():
                    return sample.value
        return 0.0


@pytest.fixture
def served(workers):
    router = Served(workers)
    router.start()
    yield router
    router.stop()


def post(body: bytes, key: str | None = USER_KEY, extra: bytes = b"") -> bytes:
    head = b"POST /generate HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n"
    if key is not None:
        head += b"authorization: Bearer " + key.encode() + b"\r\n"
    return head + b"content-length: %d\r\n" % len(body) + extra + b"\r\n" + body


def read_answer(reader) -> tuple[int, dict[str, str], bytes]:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    if "content-length" in headers:
        return status, headers, reader.read(int(headers["content-length"]))
    assert headers.get("transfer-encoding") == "chunked"
    body = b""
    while size := int(reader.readline(), 16):
        body += reader.read(size)
        reader.readline()
    reader.readline()
    return status, headers, body


def test_answers_come_on_the_connection_and_the_connection_is_kept(served):
    sent = b'{"sampling_params": {"max_new_tokens": 1},  "input_ids": [5, 6, 7], "rid": "r-1"}'
    conn, reader = served.connect()
    with conn:
        answers = []
        for _ in range(3):
            conn.sendall(post(sent))
            answers.append(read_answer(reader))
    for status, headers, body in answers:
        assert status == 200 and body == ANSWER  # the worker's bytes, as they were
        assert headers["content-type"] == "application/json"
        assert headers["x-rollout-replica"] == "0"
    assert (
        served.workers[0].bodies == [sent] * 3
        and served.workers[0].auth[0] == f"Bearer {WORKER_KEY}"
    )
    assert served.app_paths == []  # none took the ASGI app's path
    assert served.count(served.metrics.requests, endpoint="generate", status="ok") == 3
    stats = served.routing.stats()
    assert stats[0]["routed"] == 3 and stats[0]["in_flight"] == 0


def test_requests_split_over_writes_or_sent_back_to_back_are_answered_in_order(served):
    bodies = [json.dumps({"input_ids": [[i, i + 1]]}).encode() for i in (10, 20, 30)]
    conn, reader = served.connect()
    with conn:
        first = post(bodies[0])
        for piece in (first[:9], first[9:40], first[40:-5], first[-5:]):  # the head, then the body
            conn.sendall(piece)
            time.sleep(0.02)
        conn.sendall(post(bodies[1]) + post(bodies[2]))  # pipelined
        answers = [read_answer(reader) for _ in bodies]
    assert [json.loads(body)[0]["output_ids"] for _, _, body in answers] == [
        [10, 11], [20, 21], [30, 31]
    ]  # fmt: skip
    assert served.app_paths == []


def test_what_the_fast_path_does_not_take_gets_the_apps_answer(served):
    one = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).encode()
    conn, reader = served.connect()
    with conn:
        conn.sendall(post(one, key="wrong"))
        unauthorized = read_answer(reader)
        conn.sendall(post(one))  # the same connection, now uvicorn's: still served
        after = read_answer(reader)
    assert unauthorized[0] == 401 and after == (200, after[1], ANSWER)
    answers = {}
    cases = {
        "stream": post(json.dumps({"input_ids": [1, 2], "stream": True}).encode()),
        "batch": post(json.dumps({"input_ids": [[1, 2], [3, 4]]}).encode()),
        "bad": post(b'{"input_ids": [1, 2], "bogus": 1}'),
        "not json": post(b"{not json"),
        "rid": post(json.dumps({"input_ids": [1, 2], "rid": 123}).encode()),
        "chunked": (
            b"POST /generate HTTP/1.1\r\nhost: r\r\nauthorization: Bearer " + USER_KEY.encode()
            + b"\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n" % len(one) + one + b"\r\n0\r\n\r\n"
        ),
        "large": post(b" " * (2**21) + one),  # past the fast path's limit: the app reads it
        "too large": post(b" " * (64 * 2**20) + one),  # past max_request_bytes
    }  # fmt: skip
    for name, request in cases.items():
        conn, reader = served.connect()
        with conn:
            conn.sendall(request)
            answers[name] = read_answer(reader)
    assert answers["stream"][2] == b"".join(EVENTS) + b"data: [DONE]\n\n"
    assert [o["output_ids"] for o in json.loads(answers["batch"][2])] == [[1, 2], [3, 4]]
    assert answers["bad"][0] == 400 and b"bogus" in answers["bad"][2]
    assert answers["not json"][0] == 400
    assert answers["rid"][0] == 400 and b"rid" in answers["rid"][2]
    for name in ("chunked", "large"):  # the app's own path: its answer made again
        assert answers[name][0] == 200 and json.loads(answers[name][2]) == json.loads(ANSWER)
    assert answers["too large"][0] == 413
    # Each reached the app, the one with the wrong key too; the refused reached no worker:
    # the workers got the second request, the stream, the batch's two prompts, the chunked and
    # the large body.
    assert served.app_paths == ["/generate"] * (2 + len(cases))
    assert sum(len(w.bodies) for w in served.workers) == 6


@pytest.mark.parametrize(
    "rid, status, kind", [("400", 400, "invalid_request_error"), ("500", 500, "server_error")]
)
def test_a_workers_refusal_is_answered_and_counted_as_the_app_does(served, rid, status, kind):
    conn, reader = served.connect()
    with conn:
        conn.sendall(post(json.dumps({"input_ids": [1, 2], "rid": rid}).encode()))
        answer = read_answer(reader)
    error = json.loads(answer[2])["error"]
    assert answer[0] == status and error["code"] == status and error["type"] == kind
    assert f"refused with {rid}" in error["message"]
    assert served.count(served.metrics.errors, status_class=f"{status // 100}xx", type=kind) == 1
    assert served.app_paths == []


def test_a_client_that_leaves_aborts_its_request_on_the_worker(served):
    held = json.dumps({"input_ids": [1, 2], "rid": "hold"}).encode()
    conn, reader = served.connect()
    conn.sendall(post(held))
    deadline = time.monotonic() + TIMEOUT_S
    while held not in served.workers[0].bodies and time.monotonic() < deadline:
        time.sleep(0.01)
    reader.close()  # the socket closes with its last file
    conn.close()
    while not served.workers[0].left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.workers[0].left == [held]  # the worker saw the router's connection go
    while served.routing.stats()[0]["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert served.routing.stats()[0]["in_flight"] == 0
    assert served.count(served.metrics.finishes, reason=CLIENT_DISCONNECT) == 1


def test_connection_close_and_a_shutdown_close_the_connection(served):
    one = json.dumps({"input_ids": [1, 2]}).encode()
    conn, reader = served.connect()
    with conn:
        conn.sendall(post(one, extra=b"connection: close\r\n"))
        status, headers, _ = read_answer(reader)
        assert status == 200 and headers["connection"] == "close"
        assert reader.read() == b""  # closed by the router
    kept, reader = served.connect()
    with kept:
        kept.sendall(post(one))
        assert read_answer(reader)[0] == 200
        # An idle kept connection does not hold the shutdown (uvicorn waits for open ones).
        assert served.stop() < 2.0
        assert reader.read() == b""
