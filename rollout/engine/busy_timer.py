"""BusyTimer: how long the device spent computing steps, kept without ever waiting for it.

On a GPU each launch is bracketed by two timing events on the stream the step runs on; their
elapsed time is the device's own time from the step's first queued work to its last, so the
gaps between steps (the device waiting for the host to queue the next one) are what is left of
the wall time. A span is summed once its end event has completed: checked, never waited on. On
the CPU a launch computes the whole step, so the host's time inside it is the step's.

Each span is also counted under its step's kind (`step_kind`: extend, or decode with the batch
size's bucket), so a benchmark can tell which batch sizes a run's device time went to, beside
the host's own time queueing those steps: where the two are close, the device waited for the
host inside the steps (a batch launched eagerly, kernel by kernel, on a busy host).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

# Upper bounds of the decode batch-size buckets steps are counted in.
DECODE_BUCKETS = (1, 8, 32, 64, 128, 192, 256, 512, 1024, 2048)


def step_kind(decode: bool, batch_size: int) -> str:
    """"extend", or "decode LO-HI" for the bucket batch_size falls in (past the last: ">HI")."""
    if not decode:
        return "extend"
    low = 0
    for high in DECODE_BUCKETS:
        if batch_size <= high:
            return f"decode {low + 1}-{high}"
        low = high
    return f"decode >{DECODE_BUCKETS[-1]}"


class BusyTimer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds = 0.0
        self._by_kind: dict[str, list] = {}  # kind -> [steps, seconds]
        self._host_by_kind: dict[str, float] = {}  # kind -> the host's seconds in its launches
        self._pending: deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = deque()

    def time(self, launch: Callable[[], T], kind: str = "step") -> T:
        """Runs `launch`, which queues one step of `kind`, and times the device work it
        queued. A launch that raises is not counted."""
        if not self.cuda:
            start = time.perf_counter()
            result = launch()
            seconds = time.perf_counter() - start
            self._add_host(kind, seconds)
            self._add(kind, seconds)
            return result
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start = time.perf_counter()
        begin.record()
        result = launch()
        end.record()
        self._add_host(kind, time.perf_counter() - start)
        self._pending.append((kind, begin, end))
        return result

    def _add_host(self, kind: str, seconds: float) -> None:
        self._host_by_kind[kind] = self._host_by_kind.get(kind, 0.0) + seconds

    def collect(self) -> None:
        """Adds the spans of the steps the device has finished (in launch order)."""
        while self._pending and self._pending[0][2].query():
            kind, begin, end = self._pending.popleft()
            self._add(kind, begin.elapsed_time(end) / 1000)

    def _add(self, kind: str, seconds: float) -> None:
        self._seconds += seconds
        entry = self._by_kind.setdefault(kind, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds

    @property
    def by_kind(self) -> dict[str, dict[str, float]]:
        """Steps finished so far and their device seconds, by kind; `host_seconds`: the host's
        time queueing every step of the kind launched so far (one still running included)."""
        self.collect()
        return {
            k: {"steps": n, "seconds": s, "host_seconds": self._host_by_kind.get(k, 0.0)}
            for k, (n, s) in sorted(self._by_kind.items())
        }

    @property
    def seconds(self) -> float:
        """Device seconds in the steps finished so far (one still running counts once done)."""
        self.collect()
        return self._seconds
