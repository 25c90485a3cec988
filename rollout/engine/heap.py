"""The heap of a process that serves until it exits.

What start-up builds (the imported modules, the model, compiled kernels and graphs, the
tokenizer) lives as long as the process, and each of Python's full collections walks every
tracked object: with the start-up heap among them, each one is a pause of the step loop's host
thread that grows with the heap, not with what serving allocates, which is small and
short-lived (benchmarks/RESULTS.md, fortieth session). SGLang's and vLLM's engine processes
freeze their start-up heaps as well.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Collects once, then keeps every object alive now out of later collections (gc.freeze)
    for the block, and counts what those cost (collector_time). At its end the objects go back,
    so that the interpreter's exit frees them as usual (extension modules report the objects
    it did not)."""
    gc.collect()
    gc.freeze()
    collector_time()
    try:
        yield
    finally:
        gc.unfreeze()


def frozen_objects() -> int:
    """How many objects the process keeps out of the collector's walks."""
    return gc.get_freeze_count()


class CollectorTime:
    """The seconds this process spent in Python's collections so far, by generation (0, 1, 2):
    each one a pause of the thread that set it off. Counted from `install` on; one per process
    (collector_time)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._started = 0.0

    def install(self) -> CollectorTime:
        gc.callbacks.append(self._on_collection)
        return self

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.seconds[generation] += time.perf_counter() - self._started
        self.counts[generation] += 1

    def info(self) -> dict:
        return {
            "gc_seconds_by_generation": [round(s, 6) for s in self.seconds],
            "gc_collections_by_generation": list(self.counts),
        }


_process_collector_time: CollectorTime | None = None


def collector_time() -> CollectorTime:
    """This process's CollectorTime, counting from the first call."""
    global _process_collector_time
    if _process_collector_time is None:
        _process_collector_time = CollectorTime().install()
    return _process_collector_time
