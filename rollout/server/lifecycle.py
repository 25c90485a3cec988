"""The life of a `rollout serve` process: uvicorn in front of the engine, stopped cleanly by
SIGTERM or SIGINT, and stopped with exit status 1 when the engine dies.

Signals: until the engine has started, ShutdownSignals' handlers interrupt its start. The
server then runs on the engine's event loop, on the engine's thread (launch.py), where uvicorn
leaves signals alone (it installs its own only on the main thread); serve_on_loop gives
SIGINT/SIGTERM to the server as uvicorn would: the first starts a graceful shutdown, a second
SIGINT forces it. The main thread, which waits for the server, then shuts the engine down
(children reaped, IPC folder removed) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from rollout.engine.engine import RolloutEngine

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)
ENGINE_POLL_S = 0.5
EXIT_ENGINE_DIED = 1


class StartInterrupted(BaseException):
    """SIGINT or SIGTERM arrived while the engine was starting. A BaseException, as
    KeyboardInterrupt is, so that no `except Exception` on the way swallows it."""


class ShutdownSignals:
    """SIGINT/SIGTERM handlers for the whole life of the process (a context manager; restores
    the previous handlers on exit). Until `server` is set a signal raises StartInterrupted;
    after, it asks the server to stop (a no-op once it is stopping). Signals that follow a
    StartInterrupted are ignored: they would interrupt the cleanup it set off."""

    def __init__(self) -> None:
        self.server: EngineServer | None = None
        self._interrupted = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> ShutdownSignals:
        # Only the main thread may set handlers (uvicorn, too, then leaves signals alone).
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, sig: int, frame: Any) -> None:
        if self.server is not None:
            self.server.stop()
        elif not self._interrupted:
            self._interrupted = True
            raise StartInterrupted(f"{signal.Signals(sig).name} while the engine was starting")


class EngineServer(uvicorn.Server):
    """uvicorn's server over one engine. A shutdown signal first aborts the engine's requests
    (their clients get finish_reason abort) and turns new ones away (see Guard), then uvicorn
    waits for the answers to go out. If the engine dies, the server shuts down too and
    `engine_died` is set, so that the process exits non-zero and a supervisor restarts it."""

    def __init__(self, config: uvicorn.Config, engine: RolloutEngine, app_state: Any) -> None:
        super().__init__(config)
        self.engine = engine
        self.app_state = app_state
        self.engine_died = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)  # first: it tells a second SIGINT by should_exit
        self._drain()

    def stop(self) -> None:
        """Starts the shutdown as a signal would. Idempotent."""
        self._drain()
        self.should_exit = True

    def _drain(self) -> None:
        if self.app_state.stopping:
            return
        self.app_state.stopping = True
        # A thread: this runs in a signal handler, and the abort waits on the engine's loop.
        threading.Thread(target=_abort_all, args=(self.engine,), daemon=True).start()

    async def serve(self, sockets: Any = None) -> None:
        watchdog = asyncio.ensure_future(self._watch_engine())
        try:
            await super().serve(sockets)
        finally:
            watchdog.cancel()

    async def _watch_engine(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(ENGINE_POLL_S)
            if not self.should_exit and not self.engine.is_alive():
                logger.error(
                    "rollout: the engine stopped serving (%s); shutting down with exit status %d",
                    self.engine.dead_reason or "unknown reason",
                    EXIT_ENGINE_DIED,
                )
                self.engine_died = True
                self.app_state.stopping = True
                self.should_exit = True


def _abort_all(engine: RolloutEngine) -> None:
    try:
        engine.abort_request(abort_all=True)
    except Exception as e:  # noqa: BLE001 - shutting down regardless (e.g. the engine is dead)
        logger.warning("rollout: could not abort the requests in flight at shutdown: %s", e)


def server_loop() -> asyncio.AbstractEventLoop:
    """A new event loop of the kind uvicorn would run (uvloop, where it is installed): the
    loop of the engine or pool that a server runs on (serve_on_loop)."""
    return uvicorn.Config(app=None).get_loop_factory()()


def serve_on_loop(server: uvicorn.Server, owner: Any, sock: Any) -> None:
    """Runs `server` on `sock` on the event loop of `owner` (a RolloutEngine or RolloutPool
    made with server_loop: a request then reaches it with no hop between threads) until the
    server stops. uvicorn installs its signal handlers only on the main thread, which here
    waits for the server: SIGINT/SIGTERM go from it to the server's handle_exit, as uvicorn's
    would (the first starts a graceful shutdown, a second SIGINT forces it)."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, server.handle_exit) for sig in SIGNALS}
    try:
        owner.run_on_loop(server.serve(sockets=[sock]))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
