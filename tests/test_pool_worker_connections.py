"""WorkerConnections (the router's kept connections for /generate answered whole) against a
stand-in worker written on asyncio streams: what it sends, how answers of each framing are read,
when a connection is kept, and what a failure or a cancelled request leaves."""

from __future__ import annotations

import asyncio
import json

import pytest

from rollout.pool import worker_connections
from rollout.pool.worker_connections import WorkerConnections, WorkerGone


class StandIn:
    """An HTTP/1.1 server answering each request by `mode`; records the connections it saw,
    the requests (head lines, body) and the connections its client closed."""

    def __init__(self, mode: str = "length") -> None:
        self.mode = mode
        self.connections = 0
        self.requests: list[tuple[list[str], bytes]] = []
        self.client_left = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/prefix"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")[:-2]
                length = next(
                    int(v)
                    for k, v in (x.split(": ", 1) for x in lines[1:])
                    if k == "Content-Length"
                )
                body = await reader.readexactly(length)
                self.requests.append((lines, body))
                if self.mode == "hang":  # never answers: the client must leave
                    await reader.read()
                    self.client_left.set()
                    return
                answer = json.dumps({"echo": json.loads(body)}).encode()
                if self.mode == "cut":  # half an answer, then the connection closes
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\n" + answer[:5])
                    await writer.drain()
                    writer.close()
                    return
                if self.mode == "chunked":
                    half = len(answer) // 2
                    chunks = b"".join(
                        b"%x\r\n%s\r\n" % (len(c), c) for c in (answer[:half], answer[half:])
                    )
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + chunks
                        + b"0\r\n\r\n"
                    )
                else:
                    close = self.mode == "close"
                    writer.write(
                        b"HTTP/1.1 %d OK\r\nContent-Length: %d\r\n%s\r\n"
                        % (
                            201 if self.mode == "201" else 200,
                            len(answer),
                            b"Connection: close\r\n" if close else b"",
                        )
                        + answer
                    )
                    if close:
                        await writer.drain()
                        writer.close()
                        return
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.client_left.set()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


def _run(mode: str, work, **kwargs):
    async def main():
        worker = StandIn(mode)
        url = await worker.start()
        connections = WorkerConnections(url, {"Authorization": "Bearer k"})
        try:
            return await work(connections, worker)
        finally:
            connections.close()
            await worker.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["length", "chunked"])
def test_answers_are_read_whole_and_the_connection_is_kept(mode):
    async def work(connections, worker):
        answers = [
            await connections.post("/generate", json.dumps({"i": i}).encode()) for i in range(3)
        ]
        return answers, worker.connections, worker.requests

    answers, opened, requests = _run(mode, work)
    assert answers == [(200, json.dumps({"echo": {"i": i}}).encode()) for i in range(3)]
    assert opened == 1  # one kept connection carried the three
    head = requests[0][0]
    assert head[0] == "POST /prefix/generate HTTP/1.1"
    assert "Authorization: Bearer k" in head and "Content-Type: application/json" in head


def test_the_status_comes_back_as_sent():
    status, _ = _run("201", lambda c, w: c.post("/generate", b"{}"))
    assert status == 201


def test_a_connection_the_worker_closes_is_not_used_again():
    async def work(connections, worker):
        for _ in range(2):
            assert (await connections.post("/generate", b"{}"))[0] == 200
        return worker.connections

    assert _run("close", work) == 2


def test_an_idle_connection_past_the_keepalive_is_not_used(monkeypatch):
    monkeypatch.setattr(worker_connections, "KEEPALIVE_S", 0.0)

    async def work(connections, worker):
        for _ in range(2):
            await connections.post("/generate", b"{}")
        return worker.connections

    assert _run("length", work) == 2


def test_an_answer_cut_off_is_worker_gone_and_the_next_request_opens_a_new_connection():
    async def work(connections, worker):
        with pytest.raises(WorkerGone, match="closed the connection"):
            await connections.post("/generate", b"{}")
        worker.mode = "length"
        answer = await connections.post("/generate", b"{}")
        return answer, worker.connections

    (status, _), opened = _run("cut", work)
    assert (status, opened) == (200, 2)


def test_a_cancelled_request_closes_its_connection_so_the_worker_sees_its_client_leave():
    async def work(connections, worker):
        task = asyncio.ensure_future(connections.post("/generate", b"{}"))
        while not worker.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(worker.client_left.wait(), 5)
        return len(connections.idle)

    assert _run("hang", work) == 0


def test_a_worker_not_listening_is_worker_gone():
    async def work(connections, worker):
        await worker.stop()
        await worker.server.wait_closed()
        with pytest.raises(WorkerGone, match="could not connect"):
            await connections.post("/generate", b"{}")

    _run("length", work)


def test_only_plain_http_urls_are_taken():
    with pytest.raises(ValueError, match="http:// URL"):
        WorkerConnections("https://worker:443", {})
