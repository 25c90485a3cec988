"""GrammarQueue: requests whose grammar is compiling, off the step loop; each joins the
scheduler's waiting queue once its grammar is ready (or finishes with an error if it fails).

The backend is made on the first request that has a grammar (its vocabulary's tables on its own
thread, with that request's compilation): an engine that never sees one never imports xgrammar.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from rollout.engine.grammar_backend import GrammarBackend
from rollout.engine.req import Req

# With nothing else to step, how long `take_ready` waits for a compilation before the loop
# polls for new requests again.
IDLE_WAIT_S = 0.005


class GrammarQueue:
    def __init__(self, make_backend: Callable[[], GrammarBackend]) -> None:
        self._make_backend = make_backend
        self.backend: GrammarBackend | None = None
        self.pending: list[tuple[Req, Future]] = []  # in arrival order

    def __len__(self) -> int:
        return len(self.pending)

    def reqs(self) -> list[Req]:
        return [req for req, _ in self.pending]

    def add(self, req: Req) -> None:
        """Starts compiling req's grammar. Raises if there is no backend (xgrammar missing)."""
        params = req.req.params
        assert params.grammar is not None, f"{req.rid} has no grammar to compile"
        if self.backend is None:
            self.backend = self._make_backend()
        future = self.backend.submit(params.grammar, params.skip_special_tokens)
        self.pending.append((req, future))

    def take_ready(self, idle: bool) -> tuple[list[Req], list[tuple[Req, BaseException]]]:
        """The requests whose grammar is ready, with `req.grammar` set (in arrival order), and
        those whose grammar failed to compile. Requests finished meanwhile (aborted) are
        dropped. idle: nothing else to step, so wait a moment for a compilation to end."""
        if idle and self.pending and not any(f.done() for _, f in self.pending):
            wait([f for _, f in self.pending], timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        ready, failed, still = [], [], []
        for req, future in self.pending:
            if req.finished:
                future.cancel()
            elif not future.done():
                still.append((req, future))
            elif future.exception() is not None:
                failed.append((req, future.exception()))
            else:
                req.grammar = future.result()
                ready.append(req)
        self.pending = still
        return ready, failed
