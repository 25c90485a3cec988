"""Streams from the engine's loop (a thread of its own) to a caller's loop: leaving early cancels
the source, and a caller's loop closed before the source's cleanup ends raises nothing there."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time

import pytest

from rollout.engine import loop_streams


@pytest.fixture
def engine_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


def test_a_stream_left_early_by_a_loop_that_then_closes_ends_quietly(engine_loop, caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")
    cleaned = threading.Event()
    errors: list[BaseException] = []

    async def source():
        try:
            for i in range(1000):
                yield {"i": i}
                await asyncio.sleep(0.01)
        finally:
            await asyncio.sleep(0.2)  # its cleanup (an abort) outlasts the caller's loop
            cleaned.set()

    async def leave_early() -> None:
        async for _ in loop_streams.to_loop(engine_loop, source):
            break

    def record(loop, context) -> None:
        errors.append(context.get("exception") or RuntimeError(context["message"]))

    engine_loop.call_soon_threadsafe(engine_loop.set_exception_handler, record)
    asyncio.run(leave_early())  # returns, and closes its loop, before the source's cleanup
    assert cleaned.wait(5)
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), engine_loop).result(5)
    gc.collect()  # an unretrieved task error is reported when the task is collected
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), engine_loop).result(5)
    assert errors == [] and [r.getMessage() for r in caplog.records] == []


def test_the_sources_items_and_error_reach_the_callers_loop(engine_loop):
    async def source():
        yield {"i": 0}
        yield {"i": 1}
        raise ValueError("source failed")

    async def consume() -> list[dict]:
        got = []
        with pytest.raises(ValueError, match="source failed"):
            async for item in loop_streams.to_loop(engine_loop, source):
                got.append(item)
        return got

    assert asyncio.run(consume()) == [{"i": 0}, {"i": 1}]


@pytest.mark.parametrize("to", ["thread", "loop"])
def test_the_source_is_read_only_as_fast_as_the_consumer_reads(engine_loop, to):
    made: list[int] = []

    async def source():
        for i in range(100):
            made.append(i)
            yield {"i": i}

    async def read_slowly() -> list[dict]:
        stream = loop_streams.to_loop(engine_loop, source)
        got = [await anext(stream)]
        await asyncio.sleep(0.2)
        assert len(made) == 1  # nothing read ahead while the consumer was busy
        return got + [item async for item in stream]

    if to == "thread":
        stream = loop_streams.to_thread(engine_loop, source)
        got = [next(stream)]
        time.sleep(0.2)
        assert len(made) == 1
        got += list(stream)
    else:
        got = asyncio.run(read_slowly())
    assert [item["i"] for item in got] == list(range(100))
