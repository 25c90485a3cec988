"""The heap of a serving process (rollout/engine/heap.py): start-up's objects out of the
collector's walks, young objects collected less often while serving, and the caller's process as
it was afterwards."""

from __future__ import annotations

import gc

from rollout.engine.heap import YOUNG_THRESHOLD, startup_heap_frozen


def _young_collections_while(make) -> int:
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    gc.callbacks.append(count)
    try:
        kept = make()
    finally:
        gc.callbacks.remove(count)
    del kept
    return len(started)


def test_serving_collects_young_objects_less_often_then_gives_the_thresholds_back():
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    live = YOUNG_THRESHOLD // 2  # containers that stay alive, as a step's outputs do for a while
    with startup_heap_frozen():
        assert gc.get_freeze_count() > frozen  # what start-up built is out of the walks
        serving = _young_collections_while(lambda: [[] for _ in range(live)])
    assert serving == 0
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
    assert _young_collections_while(lambda: [[] for _ in range(live)]) >= live // thresholds[0]


def test_each_collection_is_counted_with_its_time_by_generation():
    from rollout.engine.heap import collector_time

    counted = collector_time()
    counts, seconds = list(counted.counts), list(counted.seconds)
    gc.collect(1)
    gc.collect(2)
    assert counted.counts[1] > counts[1] and counted.counts[2] > counts[2]
    assert counted.seconds[1] > seconds[1] and counted.seconds[2] > seconds[2]
    info = counted.info()
    assert info["gc_collections_by_generation"] == counted.counts
