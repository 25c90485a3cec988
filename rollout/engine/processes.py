"""Subprocess plumbing: ZMQ addresses, starting the scheduler and detokenizer, orphan safety.

The scheduler and detokenizer are forked from a fork server (multiprocessing's "forkserver"):
a clean interpreter, started once per process, that has imported torch, transformers and the
engine's modules but touched no GPU and runs no threads of the caller's. Each engine's children
then start without importing anything, and the fork server's own imports run beside the
caller's (start_fork_server)."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
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
    """Exits this process as soon as the engine's process `parent_pid` is gone (also when it
    was SIGKILLed), so no scheduler or detokenizer outlives the engine that started it. The
    engine is not this process's parent (the fork server is): its pid is watched instead."""
    try:
        wait = _exit_waiter(parent_pid)
    except ProcessLookupError:
        os._exit(0)

    def watch() -> None:
        wait()
        os._exit(0)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _exit_waiter(pid: int):
    """A function that returns once process `pid` has exited: it waits on a pidfd where the
    system has them (Linux 5.3: never confused with a later process given the same pid), else
    polls with signal 0. Raises ProcessLookupError when `pid` is already gone."""
    try:
        fd = os.pidfd_open(pid)  # readable once the process has exited
        return lambda: select.select([fd], [], [])
    except ProcessLookupError:
        raise
    except (AttributeError, OSError):  # no pidfds here
        os.kill(pid, 0)

    def poll() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return

    return poll


# What the children import before they run: preloaded by the fork server (names it cannot
# import are skipped), so that an engine's start imports none of them again.
PRELOAD = [
    "rollout.engine.scheduler_process",
    "rollout.engine.scheduler",
    "rollout.engine.detokenizer",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.generation.configuration_utils",
]


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_fork_server() -> None:
    """Starts this process's fork server now, if it is not running, without waiting for its
    imports: `rollout serve` calls it first, so that they run while the server imports its
    own."""
    from multiprocessing import forkserver

    _context()  # sets the preload list, which the server reads as it starts
    forkserver.ensure_running()


def start_process(target, args: tuple, name: str) -> mp.Process:
    """Starts `target(*args)` in a child of the fork server, with this process's environment as
    it is now (as a freshly started interpreter would have it). The child ignores SIGINT and
    SIGTERM: the process that started it stops it (a shutdown message, then stop_process). A
    Ctrl+C, or a SIGTERM sent to the whole process group, would otherwise kill the scheduler
    first, failing the requests in flight instead of letting the parent abort them and exit
    cleanly."""
    # Not a plain fork of the caller: it would inherit the caller's CUDA context and threads.
    proc = _context().Process(
        target=_run_child, args=(target, args, dict(os.environ)), name=name, daemon=True
    )
    proc.start()
    return proc


def _run_child(target, args: tuple, environ: dict[str, str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The fork server's environment is the one it started with; the child takes the caller's.
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def stop_process(proc: mp.Process, timeout: float) -> None:
    """Waits up to `timeout` for the child to exit on its own, then kills it (it ignores
    SIGTERM, see start_process); returns once it is reaped."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
