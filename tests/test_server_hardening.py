"""Issue 18 against one keyed server: non-streamed disconnects abort cleanly, chunked bodies over
the limit get 413, /metrics counts errors and aborts, requests belong to the key that sent them;
and no error answer carries a traceback or a file path."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from server_helpers import SERVER_ARGS, free_port

from rollout import RolloutEngine
from rollout.client import RolloutClient
from rollout.engine.tokenizer_manager import EngineDeadError, RequestFailedError
from rollout.server.app import create_app
from rollout.server.options import ServerOptions

USER = {"Authorization": "Bearer user-key"}
ADMIN = {"Authorization": "Bearer admin-key"}
LIMIT = 65536


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    """(url, path of the server's stderr log)."""
    log = str(tmp_path_factory.mktemp("hardening") / "server.log")
    port = free_port()
    keys = ["--api-key", "user-key", "--admin-api-key", "admin-key"]
    cmd = [sys.executable, "-m", "rollout.serve", "--model-path", tiny_qwen3, "--port", str(port)]
    cmd += [*SERVER_ARGS, *keys, "--max-request-bytes", str(LIMIT)]
    with open(log, "w") as f:  # a file: a pipe nobody reads could fill and stall the server
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f)
    url = f"http://127.0.0.1:{port}"
    try:
        with RolloutClient(url, api_key="admin-key") as client:
            client.wait_ready(timeout=120)
        yield url, log
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", headers=ADMIN).text


def _idle(url: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(f"{url}/get_server_info", headers=ADMIN).json()
        idle = info["num_running"] == 0 and info["num_waiting"] == 0 and info["kv_whole"]
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


class Stream:
    """A streamed /generate on a thread: `started` once its first event is in, `last` its
    final output."""

    def __init__(self, url: str, headers: dict, rid: str, max_new_tokens: int) -> None:
        params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
        self.body = {"text": "count on", "sampling_params": params, "stream": True, "rid": rid}
        self.url, self.headers = url, headers
        self.started = threading.Event()
        self.events: list[dict] = []
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        assert self.started.wait(30), "the stream produced nothing"

    def _run(self) -> None:
        with httpx.stream(
            "POST", f"{self.url}/generate", json=self.body, headers=self.headers, timeout=60
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    self.events.append(json.loads(line[6:]))
                    self.started.set()

    def last(self) -> dict:
        self.thread.join(60)
        return self.events[-1]["meta_info"]


def _abort(url: str, headers: dict, rid: str) -> httpx.Response:
    return httpx.post(f"{url}/abort_request", json={"rid": rid}, headers=headers)


def test_a_non_streamed_client_that_leaves_aborts_its_request(server):
    url, log = server
    before, generated = _metrics(url), _idle(url)["generated_tokens"]
    body = {"text": "a long one", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/generate", json=body, headers=USER, timeout=1.0)
    info = _idle(url)
    assert info["num_running"] == 0 and info["kv_whole"], info
    assert info["generated_tokens"] - generated < 3000  # aborted, not run to its end
    gone = dict(endpoint="generate", reason="client_disconnect")
    assert _metric(_metrics(url), "rollout_finish_reasons_total", **gone) == (
        _metric(before, "rollout_finish_reasons_total", **gone) + 1
    )
    with open(log) as f:
        text = f.read()
    assert "InvalidStateError" not in text and "Traceback" not in text, text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/generate", {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 8}}),
        ("/generate", {"input_ids": [5, 6, 7], "stream": True, "sampling_params": {"max_new_tokens": 8, "n": 2}}),
        ("/v1/completions", {"prompt": [5, 6, 7], "stream": True, "max_tokens": 8, "n": 2}),
    ],
    ids=["generate", "generate-n2", "completions-n2"],
)
def test_a_streamed_client_that_leaves_before_its_first_token_aborts_its_request(server, path, body):
    url, _ = server
    assert httpx.post(f"{url}/pause_generation", json={"mode": "in_place"}, headers=ADMIN).status_code == 200
    try:
        if path.startswith("/v1"):
            body = {**body, "model": httpx.get(f"{url}/v1/models", headers=USER).json()["data"][0]["id"]}
        with pytest.raises(httpx.ReadTimeout):  # paused: no first token comes
            httpx.post(f"{url}/{path.lstrip('/')}", json=body, headers=USER, timeout=1.0)
        info = _idle(url, timeout=5)
        assert info["num_waiting"] == 0 and info["num_running"] == 0, info  # aborted while queued
    finally:
        httpx.post(f"{url}/continue_generation", json={}, headers=ADMIN)


def test_a_chunked_body_over_the_limit_is_413(server):
    url, _ = server

    def chunks():
        for _ in range(LIMIT // 1024 + 8):
            yield b" " * 1024

    resp = httpx.post(f"{url}/generate", content=chunks(), headers=USER)
    assert resp.status_code == 413, resp.text
    assert "limit" in resp.json()["error"]["message"]


def test_metrics_count_errors_and_aborts(server):
    url, _ = server
    before = _metrics(url)
    bad = {"text": "hi", "sampling_params": {"temperature": -1}}
    assert httpx.post(f"{url}/generate", json=bad, headers=USER).status_code == 400
    stream = Stream(url, ADMIN, "metrics-abort", max_new_tokens=3000)
    assert _abort(url, ADMIN, "metrics-abort").status_code == 200
    assert stream.last()["finish_reason"]["type"] == "abort"
    after = _metrics(url)
    error = dict(endpoint="generate", status_class="4xx", type="invalid_request_error")
    aborted = dict(endpoint="generate", reason="abort")
    for name, labels in (
        ("rollout_request_errors_total", error),
        ("rollout_finish_reasons_total", aborted),
    ):
        assert _metric(after, name, **labels) == _metric(before, name, **labels) + 1, name
    # Counted before any route runs: a wrong key.
    unauthorized = dict(endpoint="generate", status_class="4xx", type="auth_error")
    httpx.post(f"{url}/generate", json=bad)
    assert _metric(_metrics(url), "rollout_request_errors_total", **unauthorized) >= 1


def test_a_user_key_cannot_abort_the_admins_request(server):
    url, _ = server
    stream = Stream(url, ADMIN, "admins-own", max_new_tokens=1000)
    resp = _abort(url, USER, "admins-own")
    # The same answer as for a rid that doesn't exist: it doesn't tell whether it runs.
    assert (resp.status_code, resp.json()) == (200, {"success": True})
    assert _abort(url, USER, "no-such-rid").json() == resp.json()
    meta = stream.last()
    assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == 1000


def test_a_user_key_aborts_its_own_and_the_admin_aborts_the_users(server):
    url, _ = server
    for rid, aborter in (("users-own", USER), ("users-other", ADMIN)):
        stream = Stream(url, USER, rid, max_new_tokens=3000)
        assert _abort(url, aborter, rid).status_code == 200
        assert stream.last()["finish_reason"]["type"] == "abort", rid


def test_user_abort_all_is_refused(server):
    url, _ = server
    resp = httpx.post(f"{url}/abort_request", json={"abort_all": True}, headers=USER)
    assert resp.status_code == 403


@pytest.mark.parametrize("body", [{"abort_all": "yes"}, {"abort_all": 1}, {"rid": 5}])
def test_an_abort_body_of_the_wrong_types_is_refused_not_converted(server, body):
    url, _ = server
    stream = Stream(url, USER, "kept-running", max_new_tokens=3000)
    resp = httpx.post(f"{url}/abort_request", json=body, headers=ADMIN)
    assert resp.status_code == 400 and next(iter(body)) in resp.json()["error"]["message"]
    assert _abort(url, ADMIN, "kept-running").status_code == 200  # it was running until now
    assert stream.last()["finish_reason"]["type"] == "abort"


# ---- error answers, against a stand-in engine (a real one can't be made to fail on cue) ----
class _FailingEngine:
    options = SimpleNamespace(model=SimpleNamespace(model_path="/models/secret/checkpoint"))

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def get_server_info(self) -> dict:
        raise self.exc

    def is_alive(self) -> bool:
        return True


def _answer(exc: Exception) -> tuple[httpx.Response, str]:
    """The answer to a call that raises `exc`, and the metrics text after it."""
    app = create_app(_FailingEngine(exc), ServerOptions())
    with TestClient(app, raise_server_exceptions=False) as client:
        resp = client.get("/get_server_info")
    return resp, generate_latest(app.state.metrics.registry).decode()


def test_a_bug_answers_500_with_an_error_id_and_no_trace(caplog):
    bug = KeyError("/srv/rollout/secret/file.py line 12")
    resp, metrics = _answer(bug)
    assert resp.status_code == 500
    message = resp.json()["error"]["message"]
    assert (
        "secret" not in resp.text and "Traceback" not in resp.text and "KeyError" not in resp.text
    )
    error_id = re.search(r"error id (\w+)", message).group(1)
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None  # the log has the trace, under that id
    labels = dict(endpoint="get_server_info", status_class="5xx", type="server_error")
    assert _metric(metrics, "rollout_request_errors_total", **labels) == 1


@pytest.mark.parametrize(
    "exc, status, fragment",
    [
        (RequestFailedError("request r1 failed: its forward step failed: boom"), 500, "boom"),
        (
            EngineDeadError('the scheduler failed:\nTraceback\n  File "/srv/x/y.py"\nOops: no'),
            503,
            "not serving",
        ),
    ],
    ids=["request_failed", "engine_dead"],
)
def test_engine_failures_answer_short_messages(exc, status, fragment):
    resp, _ = _answer(exc)
    assert resp.status_code == status
    assert fragment in resp.json()["error"]["message"]
    assert "/srv/" not in resp.text and "Traceback" not in resp.text


# ---- a dead engine (what `rollout serve` logs and how fast it exits, see lifecycle.py) -------
def test_a_dead_engine_says_why_and_shuts_down_without_the_graceful_wait(tiny_qwen3):
    engine = RolloutEngine(tiny_qwen3, device="cpu", dtype="float32", max_total_tokens=8192)
    try:
        assert engine.dead_reason is None and engine.is_alive()
        os.kill(engine._procs[0].pid, signal.SIGKILL)  # the scheduler
        deadline = time.monotonic() + 10
        while engine.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "rollout-scheduler exited with code -9" in (engine.dead_reason or "")
        start = time.monotonic()
        engine.shutdown()
        # The detokenizer, still running, got no shutdown message: it is killed at once, where
        # the graceful wait for it alone is 5 s.
        assert time.monotonic() - start < 3
        assert not any(p.is_alive() for p in engine._procs)
        assert engine.dead_reason == "the engine is shut down"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("n", [1, 3])
def test_an_openai_stream_with_a_rid_is_aborted_by_it_every_choice(server, path, n):
    url, _ = server
    model = httpx.get(f"{url}/v1/models", headers=USER).json()["data"][0]["id"]
    rid = f"oai-{path.rsplit('/', 1)[-1]}-{n}"
    body = {"model": model, "max_tokens": 3000, "stream": True, "n": n, "rid": rid, "ignore_eos": True}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "count on"}]
    else:
        body["prompt"] = "count on"
    started, reasons = threading.Event(), {}

    def run() -> None:
        with httpx.stream("POST", f"{url}{path}", json=body, headers=USER, timeout=60) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    for choice in json.loads(line[6:])["choices"]:
                        if choice.get("finish_reason"):
                            reasons[choice["index"]] = choice["finish_reason"]

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30)
    assert _abort(url, USER, rid).status_code == 200
    thread.join(60)
    assert not thread.is_alive()
    assert sorted(reasons) == list(range(n)) and set(reasons.values()) == {"abort"}, reasons
    assert _idle(url)["num_running"] == 0
