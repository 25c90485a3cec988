"""Subprocess plumbing: ZMQ addresses, starting the scheduler and detokenizer, orphan safety."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class Addresses:
    """Where each process listens (each binds its own PULL socket; senders connect)."""

    scheduler: str
    detokenizer: str
    tokenizer_manager: str

    @classmethod
    def fresh(cls) -> Addresses:
        base = tempfile.mkdtemp(prefix="rollout-ipc-")
        return cls(*(f"ipc://{os.path.join(base, name)}" for name in ("sched", "detok", "tm")))

    def cleanup(self) -> None:
        for addr in (self.scheduler, self.detokenizer, self.tokenizer_manager):
            path = addr.removeprefix("ipc://")
            if os.path.exists(path):
                os.unlink(path)
        base = os.path.dirname(self.scheduler.removeprefix("ipc://"))
        if os.path.isdir(base) and not os.listdir(base):
            os.rmdir(base)


def watch_parent(parent_pid: int) -> None:
    """Exits this process as soon as its parent is gone (also when the parent was SIGKILLed),
    so no scheduler or detokenizer outlives the engine that started it."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def start_process(target, args: tuple, name: str) -> mp.Process:
    """Starts `target(*args)` in a fresh interpreter. The child ignores SIGINT and SIGTERM: the
    process that started it stops it (a shutdown message, then stop_process). A Ctrl+C, or a
    SIGTERM sent to the whole process group, would otherwise kill the scheduler first, failing
    the requests in flight instead of letting the parent abort them and exit cleanly."""
    # spawn: a forked child would inherit the caller's CUDA context and threads.
    proc = mp.get_context("spawn").Process(
        target=_run_child, args=(target, args), name=name, daemon=True
    )
    proc.start()
    return proc


def _run_child(target, args: tuple) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    target(*args)


def stop_process(proc: mp.Process, timeout: float) -> None:
    """Waits up to `timeout` for the child to exit on its own, then kills it (it ignores
    SIGTERM, see start_process); returns once it is reaped."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
