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
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Collects once, then keeps every object alive now out of later collections (gc.freeze)
    for the block. At its end they go back, so that the interpreter's exit frees them as usual
    (extension modules report the objects it did not)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def frozen_objects() -> int:
    """How many objects the process keeps out of the collector's walks."""
    return gc.get_freeze_count()
