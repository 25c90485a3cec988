"""The compat tests' server and engine: the tiny model as `rollout serve` and as the Engine API
(one of each per test module), which the recorded client payloads are sent to."""

from __future__ import annotations

import pytest
from server_helpers import start_server, stop_server

from rollout.engine.engine import RolloutEngine


@pytest.fixture(scope="module")
def server(tiny_qwen3):
    proc, url = start_server(tiny_qwen3)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu") as eng:
        yield eng
