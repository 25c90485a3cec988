"""StepPipeline: one launched step stays in flight while the host plans the next.

`push(batch)` launches batch k, then applies step k-1 (waits for its results and hands them to
`on_results`) while the device computes k. What planning reads (KV lengths, slots, the prefix
cache, which requests run) advances at launch, through `on_launch`; tokens and finishes at
apply. So a request that finished in k-1 may be in k: its token is dropped and its KV freed
when k is applied. Without overlap, each step is applied right after its launch.

Failure isolation: when a batch fails to launch, nothing of it is in flight. Unless the device
itself no longer works (that raises), each request is launched alone and applied at once, and
only those that fail alone end, through `on_failure`, which finishes them (freeing their KV);
the slots planned for a launch that failed are freed here, since no request's kv_len counts them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from rollout.engine.busy_timer import BusyTimer, step_kind
from rollout.engine.kv_manager import KVManager
from rollout.engine.launched_step import LaunchedStep, ReqStepOutput
from rollout.engine.messages import failure_reason
from rollout.engine.model_runner import ModelRunner
from rollout.engine.req import Req, ScheduleBatch
from rollout.forward.forward_batch import ForwardMode

logger = logging.getLogger(__name__)


class StepPipeline:
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVManager,
        overlap: bool,
        on_launch: Callable[[ScheduleBatch], None],
        on_results: Callable[[ScheduleBatch, list[ReqStepOutput]], None],
        on_failure: Callable[[Req, dict], None],
    ) -> None:
        self.runner = runner
        self.kv = kv
        self.overlap = overlap
        self.on_launch = on_launch  # advances what planning reads, once a batch is queued
        self.on_results = on_results  # records a step's results in its requests
        self.on_failure = on_failure  # finishes a request whose own step failed
        self.in_flight: LaunchedStep | None = None  # launched, results not applied yet
        self.busy = BusyTimer(runner.device)  # the device's time in the steps pushed here

    def must_drain_first(self) -> bool:
        """Penalties read the tokens so far: requests with them wait for the step in flight
        before their next step is planned."""
        step = self.in_flight
        return step is not None and any(r.penalizes for r in step.batch.reqs)

    def push(self, batch: ScheduleBatch | None) -> None:
        """Launches `batch` (if any), then applies the step launched before it (without
        overlap: this one)."""
        previous, self.in_flight = self.in_flight, None  # planning may have drained it
        failed = None
        if batch is not None:
            try:
                kind = step_kind(batch.mode is ForwardMode.DECODE, len(batch.reqs))
                launched = self.busy.time(lambda: self.runner.launch(batch), kind)
            except Exception as e:  # noqa: BLE001 - this batch's requests fail, not the engine
                failed = e
            else:
                self.on_launch(batch)
                self.in_flight = launched
        if previous is not None:
            self._apply(previous)
        if failed is not None:
            self._isolate(batch, failed)  # after `previous`: its tokens are the requests' own
        if not self.overlap:
            self.drain()

    def drain(self) -> None:
        """Applies the step in flight, if any. Afterwards every sampled token is on the host,
        each running request's KV covers all but its newest token, and the device is done."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._apply(step)

    def _apply(self, step: LaunchedStep) -> None:
        outs = self.runner.resolve(step)
        self.busy.collect()  # the step is done: its span joins the total
        self.on_results(step.batch, outs)

    def _isolate(self, batch: ScheduleBatch, exc: Exception) -> None:
        """`batch` failed to launch, with nothing in flight now: each request is launched alone
        and applied at once; only those that fail alone finish with an error."""
        self.runner.check_device()
        if len(batch.reqs) == 1:
            self._fail_alone(batch, exc)
            return
        logger.warning(
            "a %s step of %d requests failed to launch; launching them one at a time",
            batch.mode.name.lower(), len(batch.reqs), exc_info=exc,
        )  # fmt: skip
        for one in batch.split():
            if one.reqs[0].finished:
                self._fail_alone(one, exc)
                continue
            try:
                launched = self.runner.launch(one)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                self.runner.check_device()
                self._fail_alone(one, e)
            else:
                self.on_launch(one)
                self._apply(launched)

    def _fail_alone(self, one: ScheduleBatch, exc: Exception) -> None:
        """A one-request step failed to launch: the slots planned for it are freed (its kv_len
        does not count them) and the request finishes with an error, unless the step applied
        just before finished it."""
        self.kv.free_unused(one.out_cache_loc)
        req = one.reqs[0]
        if req.finished:
            return
        during = f"its {one.mode.name.lower()} step"
        logger.error("request %s failed: %s failed to launch", req.rid, during, exc_info=exc)
        self.on_failure(req, failure_reason(during, exc))
