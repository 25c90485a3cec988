"""`rollout serve` as a process: SIGTERM and SIGINT stop it cleanly (requests in flight end with
abort, children reaped, IPC folder removed, exit 0, no traceback); a dead engine stops it with
exit status 1 so that a supervisor restarts it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from process_helpers import descendants, still_alive
from server_helpers import SERVER_ARGS, free_port

from rollout.client import RolloutClient


@contextmanager
def _server(model_path: str, log_path: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """A ready server whose stderr goes to a file (a pipe nobody reads could fill and stall
    it); killed on the way out if the test left it running."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.serve", "--model-path", model_path, "--port", str(port)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*cmd, *SERVER_ARGS], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        with RolloutClient(url) as client:
            client.wait_ready(timeout=120)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _unix_sockets(pid: int) -> list[str]:
    """Paths of the unix sockets process `pid` holds (its ZMQ ipc:// endpoints among them)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    paths = []
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 8 and parts[6] in inodes:
                paths.append(parts[7])
    return paths


def _ipc_dir(pid: int) -> str:
    [folder] = {os.path.dirname(p) for p in _unix_sockets(pid) if "rollout-ipc-" in p}
    return folder


def _scheduler(children: list[int]) -> int:
    """The child that listens on the IPC folder's `sched` socket."""
    [pid] = [c for c in children if any(p.endswith("/sched") for p in _unix_sockets(c))]
    return pid


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_shutdown_signal_aborts_requests_reaps_children_and_exits_0(tiny_qwen3, tmp_path, sig):
    log = str(tmp_path / "server.log")
    events: list[dict] = []
    with _server(tiny_qwen3, log) as (proc, url):
        children = descendants(proc.pid)
        assert len(children) >= 2  # the scheduler and the detokenizer (and their fork server)
        ipc_dir = _ipc_dir(proc.pid)
        assert os.path.isdir(ipc_dir)
        streaming = threading.Event()

        def stream() -> None:
            params = {"max_new_tokens": 4000, "ignore_eos": True}
            body = {"text": "go on", "sampling_params": params, "stream": True}
            with httpx.stream("POST", f"{url}/generate", json=body, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        streaming.set()

        client = threading.Thread(target=stream, daemon=True)
        client.start()
        assert streaming.wait(30), "the stream produced nothing"
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
        client.join(timeout=15)
    assert not client.is_alive()
    finish = events[-1]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort", events[-1]
    assert events[-1]["meta_info"]["completion_tokens"] < 4000
    with open(log) as f:
        stderr = f.read()
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert still_alive(children, within_s=5, reaped=True) == []
    assert not os.path.exists(ipc_dir)


def test_a_dead_scheduler_fails_health_at_once_and_the_server_exits_1(tiny_qwen3, tmp_path):
    log = str(tmp_path / "server.log")
    with _server(tiny_qwen3, log) as (proc, url):
        children = descendants(proc.pid)
        scheduler = _scheduler(children)
        ipc_dir = _ipc_dir(proc.pid)
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(scheduler, signal.SIGKILL)
        killed = time.monotonic()
        answer = None  # the first that is not 200: 503, or "closed" when already exiting
        while answer is None and time.monotonic() - killed < 5:  # a loaded 2-core machine
            try:
                status = httpx.get(f"{url}/health", timeout=1).status_code
            except httpx.TransportError:
                answer = "closed"
                break
            answer = None if status == 200 else status
            time.sleep(0.02)
        assert answer in (503, "closed"), f"/health answered {answer or 200} 5 s after the scheduler died"
        assert proc.wait(timeout=20) == 1
    with open(log) as f:
        stderr = f.read()
    assert "the engine stopped serving" in stderr, stderr
    assert still_alive(children, within_s=5, reaped=True) == []
    assert not os.path.exists(ipc_dir)


@pytest.mark.parametrize("command", ["serve", "router"])
def test_a_port_in_use_fails_before_anything_starts_and_names_the_port(tiny_qwen3, command):
    # Bound before the engine (or the pool) starts: a 7B model would otherwise load for minutes
    # before uvicorn found the port taken.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = (
            ["--model-path", tiny_qwen3, *SERVER_ARGS]
            if command == "serve"
            else ["--worker-urls", "http://127.0.0.1:1"]
        )
        done = subprocess.run(
            [sys.executable, "-m", "rollout.cli", command, *args, "--port", str(port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "kernel plan" not in done.stderr  # no scheduler ever started


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dtype", "float33"], "dtype must be one of"),
        (["--max-total-tokens", "-5"], "max_total_tokens"),
        (["--model-path", "/nonexistent/model"], "checkpoint directory with config.json"),
    ],
)
def test_a_bad_option_is_one_line_before_anything_starts(tiny_qwen3, args, message):
    cmd = [sys.executable, "-m", "rollout.cli", "serve", "--model-path", tiny_qwen3, "--device", "cpu"]
    done = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("rollout serve: error: ") and message in done.stderr
    assert "Traceback" not in done.stderr and "kernel plan" not in done.stderr


@pytest.mark.parametrize(
    ("urls", "message"),
    [
        (["notaurl"], "worker URL 'notaurl' is not http(s)://host[:port]"),
        (["http://127.0.0.1:99999"], "is not http(s)://host[:port]"),
        (["http://127.0.0.1:5000", "http://127.0.0.1:5000/"], "is given twice"),
    ],
)
def test_a_bad_worker_url_is_one_line_before_the_router_starts(urls, message):
    # It used to wait 120 s for "notaurl" to answer /health.
    done = subprocess.run(
        [sys.executable, "-m", "rollout.cli", "router", "--worker-urls", *urls, "--port", str(free_port())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.startswith("rollout router: error: ") and message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_router_stopped_while_it_waits_for_its_workers_exits_0_cleanly():
    # SIGTERM while the pool waits for a worker's /health: exit 0 with the pool's pending start
    # cancelled (it was left pending in a stopped event loop, which asyncio reported at exit).
    cmd = [sys.executable, "-m", "rollout.cli", "router", "--worker-urls", f"http://127.0.0.1:{free_port()}"]
    proc = subprocess.Popen([*cmd, "--port", str(free_port())], stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    assert "waiting up to" in first, first
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert "Task was destroyed" not in rest and "Traceback" not in rest, rest
