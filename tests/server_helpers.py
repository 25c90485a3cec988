"""Starting `rollout serve` subprocesses on free loopback ports for the server tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from rollout.client import RolloutClient

SERVER_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _popen(cmd: list[str]) -> subprocess.Popen:
    """`cmd` with its stderr in a temporary file (`proc.log`): a pipe nobody reads fills after
    a few logged tracebacks and stalls the server on its next log line."""
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _log(proc: subprocess.Popen) -> str:
    proc.log.seek(0)  # type: ignore[attr-defined]
    return proc.log.read()  # type: ignore[attr-defined]


def start_server(model_path: str, *args: str, api_key: str | None = None) -> tuple[subprocess.Popen, str]:
    """Starts a server and waits until it generates. Returns the process and its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.serve", "--model-path", model_path, "--port", str(port), *SERVER_ARGS, *args]
    proc = _popen(cmd)
    url = f"http://127.0.0.1:{port}"
    client = RolloutClient(url, api_key=api_key)
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited during startup:\n{_log(proc)}")
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready within 120 s")
            try:
                client.wait_ready(timeout=2)
                return proc, url
            except TimeoutError:
                continue
    except BaseException:
        stop_server(proc)
        raise
    finally:
        client.close()


def start_process(cmd: list[str], url: str, api_key: str | None = None) -> subprocess.Popen:
    """Starts `cmd` (a server or router serving `url`) and waits until it is ready."""
    proc = _popen(cmd)
    client = RolloutClient(url, api_key=api_key)
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and not client.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{cmd} did not answer /health within 120 s")
            time.sleep(0.2)
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd} exited during startup:\n{_log(proc)}")
        client.wait_ready(timeout=60)
    except BaseException:
        stop_server(proc)
        raise
    finally:
        client.close()
    return proc


def stop_server(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    if getattr(proc, "log", None) is not None:
        proc.log.close()


def health_latencies_while(url: str, body: bytes) -> tuple[httpx.Response, list[float]]:
    """Posts body to /generate on one connection and polls /health on another until it is
    answered. Returns the answer and every /health latency (each /health must be a 200)."""
    answer: dict = {}

    def send() -> None:
        headers = {"content-type": "application/json"}
        answer["resp"] = httpx.post(url + "/generate", content=body, headers=headers, timeout=300)

    sender = threading.Thread(target=send)
    latencies = []
    with httpx.Client(base_url=url, timeout=30) as http:
        http.get("/health")
        sender.start()
        while sender.is_alive():
            start = time.monotonic()
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.005)
    sender.join()
    return answer["resp"], latencies
