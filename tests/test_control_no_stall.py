"""Monitoring never stalls generation (issue 25): get_server_info and get_weight_version (and
with them /get_load, /v1/loads and /metrics, which read get_server_info) are answered between
steps without applying the step in flight early, so with overlap scheduling on, the outputs and
the schedule stay what they are unpolled. Calls that change state (flush_cache here) still
drain first; the scheduler counts those drains in get_server_info's pipeline_drains.

First in the scheduler's own process (deterministic: a call after every step), then through
the engine's processes and the HTTP routes while a generation runs."""

from __future__ import annotations

import re
import threading
import time
from collections import defaultdict

import pytest
import torch
from devices import CPU_AND_CUDA
from fastapi.testclient import TestClient

from rollout import RolloutEngine
from rollout.config import EngineOptions
from rollout.control import ControlCall
from rollout.engine.busy_timer import BusyTimer
from rollout.engine.control_calls import FlushCache, GetServerInfo
from rollout.engine.messages import ControlRequest, ReqOutputBatch, TokenizedRequest
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.scheduler_process import SchedulerProcess
from rollout.server.app import create_app
from rollout.server.options import ServerOptions
from rollout.weight_sync.calls import GetWeightVersion

MAX_NEW = 120
PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(12 + 5 * i)] for i in range(6)]
PARAMS = [
    {"temperature": 0.8, "seed": 11 + i, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    for i in range(len(PROMPTS))
]


class _Sink:
    """The scheduler's socket to the detokenizer: keeps the output batches it is sent."""

    def __init__(self) -> None:
        self.batches: list[ReqOutputBatch] = []

    def send_pyobj(self, obj: object) -> None:
        self.batches.append(obj)


def _step_with(path: str, calls: list[ControlCall]) -> tuple[dict, int, int, int]:
    """Steps a scheduler through the workload; after every step that leaves requests running,
    `calls` arrive as control calls. Returns the output ids by rid, the pipeline drains, how many
    calls arrived, and after how many of them the step in flight was still the one launched."""
    options = EngineOptions.from_kwargs(
        model_path=path, device="cpu", dtype="float32", max_total_tokens=2048
    )
    proc = SchedulerProcess(options)
    sched, sink = proc.scheduler, _Sink()
    for i, (ids, params) in enumerate(zip(PROMPTS, PARAMS)):
        sched.add_request(TokenizedRequest(f"r{i}", ids, SamplingParams(**params), seed=i))
    ids: dict[str, list[int]] = defaultdict(list)
    arrived = kept = 0
    while sched.has_work():
        for req in sched.step():
            out = sched.make_output(req)
            ids[out.rid] += out.new_ids
        for call in calls if sched.has_requests() else ():
            launched = sched.in_flight
            reply = proc._receive_control(ControlRequest(arrived, call).to_frames(), sink)
            assert reply is not None and reply.error is None, reply
            arrived += 1
            kept += launched is not None and sched.in_flight is launched
    for batch in sink.batches:  # outputs a draining call sent ahead of its reply
        for out in batch.outputs:
            ids[out.rid] += out.new_ids
    assert sched.server_info()["kv_whole"]
    return dict(ids), sched.stats["pipeline_drains"], arrived, kept


def test_read_only_calls_between_every_step_leave_the_step_in_flight(tiny_qwen3):
    quiet, quiet_drains, _, _ = _step_with(tiny_qwen3, [])
    assert quiet_drains == 0  # no penalties, KV to spare: overlap is never broken
    assert all(len(v) == MAX_NEW for v in quiet.values()) and len(quiet) == len(PROMPTS)
    polled, drains, arrived, kept = _step_with(tiny_qwen3, [GetServerInfo(), GetWeightVersion()])
    assert arrived >= 2 * MAX_NEW and kept == arrived  # no call applied the step early
    assert drains == 0
    assert polled == quiet


def test_a_call_that_changes_state_still_drains_the_step_in_flight(tiny_qwen3):
    """flush_cache is refused while requests run, but drains first, as every state change does:
    each is counted, and the tokens are the same regardless."""
    quiet, _, _, _ = _step_with(tiny_qwen3, [])
    flushed, drains, arrived, kept = _step_with(tiny_qwen3, [FlushCache()])
    assert arrived >= MAX_NEW and kept == 0 and drains == arrived
    assert flushed == quiet


# ---- through the engine's processes and the HTTP routes ---------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=4096) as eng:
        assert eng.get_server_info()["pipeline_drains"] == 0
        yield eng


@pytest.fixture(scope="module")
def http(engine):
    with TestClient(create_app(engine, ServerOptions())) as client:
        yield client


def test_polling_the_monitoring_routes_during_a_generation_forces_no_drain(engine, http):
    engine.flush_cache()
    outs: list = []
    params = [{**p, "max_new_tokens": 3 * MAX_NEW} for p in PARAMS]
    worker = threading.Thread(
        target=lambda: outs.extend(engine.generate(input_ids=PROMPTS, sampling_params=params))
    )
    worker.start()
    busy = 0
    while worker.is_alive():
        info = engine.get_server_info()
        load = http.get("/get_load").json()[0]
        assert http.get("/v1/loads").status_code == 200
        assert "rollout_num_running_reqs" in http.get("/metrics").text
        busy += info["num_running"] > 0 and load["num_running_reqs"] > 0
        time.sleep(0.005)  # as a monitor polls, leaving the scheduler its CPU
    worker.join()
    assert busy >= 3, f"only {busy} polls saw the generation running"
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3 * MAX_NEW] * len(PROMPTS)
    # /metrics carries the scheduler's totals: no drain, and the device's time in steps.
    text = http.get("/metrics").text
    assert re.search(r"^rollout_pipeline_drains 0\.0$", text, re.M), text
    busy_s = float(re.search(r"^rollout_device_busy_seconds (\S+)$", text, re.M).group(1))
    assert busy_s == pytest.approx(engine.get_server_info()["device_busy_s"]) and busy_s > 0


def test_an_idle_engine_reports_itself_idle_right_after_its_outputs(engine):
    """Once the last outputs are back, the step still in flight (it only drops the finished
    requests' extra tokens) is applied before answering: nothing is left running or held."""
    short = [{**p, "max_new_tokens": 5} for p in PARAMS[:2]]
    for _ in range(3):
        engine.generate(input_ids=PROMPTS[:2], sampling_params=short)
        info = engine.get_server_info()
        assert info["num_running"] == info["num_waiting"] == 0
        assert info["kv_whole"] and info["kv_in_requests"] == 0


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_the_busy_timer_counts_the_device_time_of_launches_only(device):
    """device_busy_s: what a launch queued, timed on the device, never the gaps between."""
    timer = BusyTimer(torch.device(device))
    x = torch.randn(512, 512, device=device)
    start = time.perf_counter()
    for _ in range(5):
        timer.time(lambda: [x @ x for _ in range(20)])
        time.sleep(0.02)  # the device idles here: not counted
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    busy = timer.seconds
    assert 0 < busy < wall - 5 * 0.02
    assert timer.seconds == busy  # nothing pending is counted twice
