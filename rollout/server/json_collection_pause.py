"""No automatic garbage collection while a large parsed body is alive, for a bounded time.

A collection of a generation walks every item of every container in it, holding the GIL, and
with it the server's event loop, throughout. A parsed body of ten million items is new, so the
next young collection walks it, whichever thread sets it off (the loop's too), and the one
after that as it ages: each walk a stall of the loop as long as a /health answer may take.
So collections stop from the start of a large body's parse until what is left of it has been
released (json_release), when the request is done: by then the body is gone, and the walks
it would have cost with it.

One pause lasts at most MAX_PAUSE_S: collections then resume even if bodies are alive
(overlapping large requests would otherwise keep them off for good), and a body still alive is
walked as it ages, as any object is.

NOTE: nothing here asks how many objects are frozen: gc.get_freeze_count() walks the whole
permanent generation, holding the GIL (the server freezes what start-up made, launch.py).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

MAX_PAUSE_S = 30.0  # cyclic garbage made meanwhile waits this long at most


class CollectionPause:
    """Counts the large bodies alive (hold, let_go); automatic collections are off while the
    count is above zero, for MAX_PAUSE_S at most per pause. Thread-safe."""

    def __init__(self, max_pause_s: float = MAX_PAUSE_S) -> None:
        self.max_pause_s = max_pause_s
        self._lock = threading.Lock()
        self._holders = 0
        self._paused = False  # collections are off, by this pause
        self._resume = False  # collections were on when it began
        self._timer: threading.Timer | None = None
        self._pauses = 0  # pauses begun: an overdue timer ends its own pause only

    @property
    def holders(self) -> int:
        return self._holders

    def hold(self) -> None:
        """One more large body alive. The first of a run of them stops collections."""
        with self._lock:
            self._holders += 1
            if self._holders == 1:
                self._resume = gc.isenabled()
                gc.disable()
                self._paused = True
                self._pauses += 1
                self._timer = threading.Timer(self.max_pause_s, self._end_overdue, (self._pauses,))
                self._timer.daemon = True
                self._timer.start()

    def let_go(self) -> None:
        """One large body fewer (its remains released). The last ends the pause."""
        with self._lock:
            if self._holders <= 0:
                raise RuntimeError("CollectionPause.let_go without a hold")
            self._holders -= 1
            if self._holders == 0:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
                self._end()

    @contextmanager
    def __call__(self) -> Iterator[None]:
        self.hold()
        try:
            yield
        finally:
            self.let_go()

    def _end_overdue(self, pause: int) -> None:
        with self._lock:
            if pause == self._pauses:
                self._end()

    def _end(self) -> None:
        """Resumes collections if this pause stopped them (the lock held)."""
        if not self._paused:
            return
        self._paused = False
        if self._resume:
            gc.enable()


collections_paused = CollectionPause()
