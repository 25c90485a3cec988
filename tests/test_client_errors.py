"""RolloutClient against a server it cannot reach, that never answers, or that hangs up: each
call raises an error naming the server's URL and the route, not httpx's bare transport error."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from rollout.client import RolloutClient
from rollout.errors import ServerUnreachable


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def listener():
    """A socket that takes connections and never answers; yields (url, hang_up) where
    hang_up() makes it close each connection after reading the request."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    mode = {"hang_up": False}
    conns = []

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            conns.append(conn)
            if mode["hang_up"]:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Len")  # cut mid-header
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", lambda: mode.update(hang_up=True)
    sock.close()
    for conn in conns:
        conn.close()


def test_a_server_not_running_is_named_in_every_kind_of_call():
    url = f"http://127.0.0.1:{_closed_port()}"
    with RolloutClient(url, timeout=5) as client:
        calls = {
            "/generate": lambda: client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2}),
            "/get_server_info": client.get_server_info,
            "/flush_cache": client.flush_cache,
        }
        for route, call in calls.items():
            with pytest.raises(ServerUnreachable, match=f"cannot reach the rollout server at {url} \\({route}\\)"):
                call()
        with pytest.raises(ConnectionError, match=url):  # a built-in type callers already catch
            list(client.generate(input_ids=[1, 2], stream=True))
        with pytest.raises(ServerUnreachable, match=url):
            asyncio.run(client.async_generate(input_ids=[1, 2]))

        async def stream() -> None:
            async for _ in await client.async_generate(input_ids=[1, 2], stream=True):
                pass

        with pytest.raises(ServerUnreachable, match=url):
            asyncio.run(stream())
        assert client.health() is False


def test_no_answer_within_the_timeout_and_a_dropped_connection_name_the_server(listener):
    url, hang_up = listener
    with RolloutClient(url, timeout=0.5) as client:
        with pytest.raises(TimeoutError, match=f"{url}/get_server_info: no answer within the client's timeout"):
            client.get_server_info()
        hang_up()
        with pytest.raises(ServerUnreachable, match=f"lost the connection to {url}/generate"):
            client.generate(input_ids=[1, 2])


@pytest.mark.parametrize("url", ["127.0.0.1:30000", "ftp://host", "http://", "http://host:99999"])
def test_a_url_that_is_not_http_is_refused_when_the_client_is_made(url):
    # It used to fail at the first call as a "lost connection" (httpx's UnsupportedProtocol).
    with pytest.raises(ValueError, match="is not http\\(s\\)://host\\[:port\\]"):
        RolloutClient(url)
