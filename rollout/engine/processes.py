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
    """Where each process listens (each binds its own PULL socket; senders connect). With
    tensor parallelism, rank 0's scheduler sends each other rank its steps on `tp_steps[r - 1]`
    and hears their replies on `tp_replies`; `tp_init` rendezvouses the ranks' process group."""

    scheduler: str
    detokenizer: str
    tokenizer_manager: str
    tp_steps: tuple[str, ...] = ()
    tp_replies: str = ""
    tp_init: str = ""

    @classmethod
    def fresh(cls, tp_size: int = 1) -> Addresses:
        base = tempfile.mkdtemp(prefix="rollout-ipc-")

        def ipc(name: str) -> str:
            return f"ipc://{os.path.join(base, name)}"

        if tp_size == 1:
            return cls(ipc("sched"), ipc("detok"), ipc("tm"))
        steps = tuple(ipc(f"tp-steps-{r}") for r in range(1, tp_size))
        init = f"file://{os.path.join(base, 'tp-init')}"
        return cls(ipc("sched"), ipc("detok"), ipc("tm"), steps, ipc("tp-replies"), init)

    def cleanup(self) -> None:
        base = os.path.dirname(self.scheduler.removeprefix("ipc://"))
        if os.path.isdir(base):
            for name in os.listdir(base):  # the sockets, and the rendezvous file
                os.unlink(os.path.join(base, name))
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
