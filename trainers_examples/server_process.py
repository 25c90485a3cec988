"""`rollout serve` as a child process of the trainer: started on a free port, waited for, stopped
when the trainer's block ends, also on an error, Ctrl-C or SIGTERM; on Linux it also exits
when the trainer is killed outright.

The server's stdout goes to the trainer's stderr, so that the trainer's stdout stays its own
(the examples end it with one JSON line).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from rollout.client import RolloutClient

# Runs in the child, then execs `rollout serve` in its place (same pid): the server gets SIGTERM
# when the trainer dies, even by SIGKILL (PR_SET_PDEATHSIG, which the exec keeps), so that it
# cannot outlive the trainer. argv: the trainer's pid, then the server's python arguments.
_EXEC_WITH_PARENT_DEATH_SIGNAL = """
import ctypes, os, signal, sys
PR_SET_PDEATHSIG = 1
ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):  # the trainer died before the prctl
    sys.exit(1)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def option_flags(options: dict[str, Any]) -> list[str]:
    """Engine options as `rollout serve` flags: --name value, or a bare --name for True."""
    flags: list[str] = []
    for name, value in options.items():
        if value is None or value is False:
            continue
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


@contextlib.contextmanager
def serve(
    model_path: str, options: dict[str, Any], api_key: str | None, timeout_s: float
) -> Iterator[str]:
    """Runs `python -m rollout.serve` on a free loopback port until the block ends; yields its
    URL once it generates. Raises with the server's exit code if it dies while starting."""
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.serve", "--model-path", model_path, "--port", str(port)]
    if sys.platform == "linux":
        cmd[1:1] = ["-c", _EXEC_WITH_PARENT_DEATH_SIGNAL, str(os.getpid())]
    cmd += option_flags(options)
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        with _sigterm_as_exit():
            _wait_ready(proc, url, api_key, timeout_s)
            print(f"rollout serve (pid {proc.pid}) is ready at {url}", file=sys.stderr, flush=True)
            yield url
    finally:
        _stop(proc)


@contextlib.contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    """SIGTERM raises SystemExit in the trainer while the server runs: Python's default would
    end the trainer on the spot and leave the server running; this way _stop runs first."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; an error then still stops the server
        return

    def raise_exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, raise_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_ready(proc: subprocess.Popen, url: str, api_key: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with RolloutClient(url, api_key=api_key) as client:
        while True:
            if proc.poll() is not None:
                code = proc.returncode
                raise RuntimeError(
                    f"rollout serve exited with code {code} while starting (its log is above)"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rollout serve was not ready within {timeout_s:g} s; raise --server-timeout"
                )
            try:
                client.wait_ready(timeout=2)
                return
            except TimeoutError:
                continue


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM (the server aborts what is in flight and exits), SIGKILL if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
