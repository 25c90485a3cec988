"""max_running_requests: unset, it follows the KV pool (a larger pool decodes larger batches);
set, it is the limit the scheduler admits to, whatever the pool."""

from __future__ import annotations

import pytest

from rollout.config import (
    MAX_RUNNING_REQUESTS,
    MIN_RUNNING_REQUESTS,
    RUNNING_TOKENS_PER_REQUEST,
    EngineOptions,
    SchedulerOptions,
)
from rollout.engine.messages import TokenizedRequest
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.scheduler_process import SchedulerProcess


def _process(model: str, **options) -> SchedulerProcess:
    opts = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096, **options}
    return SchedulerProcess(EngineOptions.from_kwargs(model_path=model, **opts))


def test_the_default_limit_grows_with_the_pool_within_its_bounds():
    default = SchedulerOptions()
    assert default.running_limit(4096) == MIN_RUNNING_REQUESTS
    pool = 700 * RUNNING_TOKENS_PER_REQUEST + 5
    assert default.running_limit(pool) == 700
    assert default.running_limit(10**9) == MAX_RUNNING_REQUESTS
    assert SchedulerOptions(max_running_requests=3).running_limit(10**9) == 3
    with pytest.raises(ValueError, match="max_running_requests must be >= 1, got 0"):
        SchedulerOptions(max_running_requests=0)


def test_the_engine_serves_with_the_limit_resolved_for_its_pool(tiny_qwen3):
    tokens = (MIN_RUNNING_REQUESTS + 36) * RUNNING_TOKENS_PER_REQUEST
    proc = _process(tiny_qwen3, max_total_tokens=tokens)
    limit = MIN_RUNNING_REQUESTS + 36
    assert proc.options.scheduler.max_running_requests == limit
    assert proc.scheduler.prefill.options.max_running_requests == limit
    assert proc.runner.req_to_token.max_reqs == limit + 1  # one spare row
    assert proc.info["max_running_requests"] == limit
    small = _process(tiny_qwen3)
    assert small.info["max_running_requests"] == MIN_RUNNING_REQUESTS


def test_a_set_limit_caps_the_requests_decoding_at_once(tiny_qwen3):
    proc = _process(tiny_qwen3, max_running_requests=2)
    assert proc.info["max_running_requests"] == 2
    sched = proc.scheduler
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for i in range(5):
        sched.add_request(TokenizedRequest(f"r{i}", [3, 1 + i, 4], params, seed=i))
    most, done = 0, set()
    while sched.has_work():
        done |= {req.rid for req in sched.step() if req.finished}
        most = max(most, sched.server_info()["num_running"])
    assert most == 2 and done == {f"r{i}" for i in range(5)}
