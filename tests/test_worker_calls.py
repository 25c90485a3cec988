"""A call run on the engine's worker threads lets go of its arguments as it ends, whether it
returns or raises: a large request must not outlive its answer in an executor's work item."""

from __future__ import annotations

import asyncio
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout.engine.worker_calls import _Call, run_in
from rollout.errors import InvalidRequest


def _refuse(request: list) -> None:
    raise InvalidRequest(f"{len(request)} tokens: too many")


def test_a_call_holds_nothing_of_its_arguments_after_it_returns_or_raises():
    request = list(range(10))
    alone = sys.getrefcount(request)
    returning = _Call(len, (request,), {})
    assert returning() == 10
    assert sys.getrefcount(request) == alone

    raising = _Call(_refuse, (request,), {})
    with pytest.raises(InvalidRequest) as info:
        raising()
    # The error's traceback keeps the frames; with the refusing check's cleared (as the server
    # does), nothing holds the request, not even the call's own frame.
    traceback.clear_frames(info.value.__traceback__)
    assert raising.parts is None
    assert sys.getrefcount(request) == alone


def test_run_in_gives_the_result_and_the_error_of_the_call():
    async def main() -> None:
        with ThreadPoolExecutor(1) as workers:
            assert await run_in(workers, sum, [1, 2, 3], start=4) == 10
            with pytest.raises(InvalidRequest, match="3 tokens: too many"):
                await run_in(workers, _refuse, [1, 2, 3])

    asyncio.run(main())
