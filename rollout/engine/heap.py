"""The heap of a process that serves until it exits.

What start-up builds (the imported modules, the model, compiled kernels and graphs, the
tokenizer) lives as long as the process, and each of Python's full collections walks every
tracked object: with the start-up heap among them, each one is a pause of the step loop's host
thread that grows with the heap, not with what serving allocates, which is small and
short-lived (benchmarks/RESULTS.md, fortieth session). SGLang's and vLLM's engine processes
freeze their start-up heaps as well.

What serving does allocate comes fast: a decode step of a thousand requests makes thousands of
containers (a step's outputs, logprob rows), most of them gone within the step. At Python's
default threshold (a young collection every 700 net allocations, a full one every hundred of
those) the live requests' token lists were walked in a full collection every ~70,000, and each
walk grows with every request's tokens so far. Serving collects its young objects every
YOUNG_THRESHOLD allocations instead.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

# Net container allocations between two collections of the youngest generation while serving
# (Python's default: 700); the older generations keep their default ratios to it.
YOUNG_THRESHOLD = 20_000


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Collects once, then keeps every object alive now out of later collections (gc.freeze)
    and collects young objects every YOUNG_THRESHOLD allocations for the block, and counts what
    collections cost (collector_time). At its end the objects go back, so that the
    interpreter's exit frees them as usual (extension modules report the objects it did not),
    and the thresholds are Python's again."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])
    collector_time()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
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
