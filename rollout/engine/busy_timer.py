"""BusyTimer: how long the device spent computing steps, kept without ever waiting for it.

On a GPU each launch is bracketed by two timing events on the stream the step runs on; their
elapsed time is the device's own time from the step's first queued work to its last, so the
gaps between steps (the device waiting for the host to queue the next one) are what is left of
the wall time. A span is summed once its end event has completed: checked, never waited on. On
the CPU a launch computes the whole step, so the host's time inside it is the step's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


class BusyTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()

    def time(self, launch: Callable[[], T]) -> T:
        """Runs `launch`, which queues one step, and times the device work it queued. A launch
        that raises is not counted."""
        if not self.cuda:
            start = time.perf_counter()
            result = launch()
            self._seconds += time.perf_counter() - start
            return result
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        result = launch()
        end.record()
        self._pending.append((begin, end))
        return result

    def collect(self) -> None:
        """Adds the spans of the steps the device has finished (in launch order)."""
        while self._pending and self._pending[0][1].query():
            begin, end = self._pending.popleft()
            self._seconds += begin.elapsed_time(end) / 1000

    @property
    def seconds(self) -> float:
        """Device seconds in the steps finished so far (one still running counts once done)."""
        self.collect()
        return self._seconds
