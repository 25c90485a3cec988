"""Scheduler: continuous batching over one ModelRunner, composed of small helpers.

Each step is a prefill (PrefillPlanner: new requests and prompt chunks under a token budget)
or else a decode (DecodePlanner: a token for every running request, retracting the newest to
the front of the queue when the KV pool runs dry). StepPipeline keeps one batch in flight while
the previous one is applied; ResultRecorder records results and finishes requests, freeing
their KV. Every call that changes requests or weights from outside `drain`s first.

Requests are `waiting` (queued or retracted), `chunked` (mid-prefill) or `running` until they
finish. An exception while adding a request, launching a batch or recording one request's
results finishes those requests with finish_reason {"type": "error"} and the scheduler serves
on; one that no request explains (planning, the device) propagates and the process exits.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from rollout.config import EngineOptions
from rollout.engine.decode_planner import DecodePlanner
from rollout.engine.grammar_backend import GrammarBackend
from rollout.engine.grammar_queue import GrammarQueue
from rollout.engine.heap import collector_time, frozen_objects
from rollout.engine.kv_manager import KVManager
from rollout.engine.launched_step import LaunchedStep, ReqStepOutput
from rollout.engine.lora_calls import LoadLoraAdapter, UnloadLoraAdapter
from rollout.engine.lora_manager import LoraManager
from rollout.engine.messages import AbortRequest, ReqOutput, TokenizedRequest, failure_reason
from rollout.engine.model_runner import ModelRunner
from rollout.engine.new_token_ratio import NewTokenRatio
from rollout.engine.prefill_planner import PrefillPlanner
from rollout.engine.req import Req, ScheduleBatch
from rollout.engine.result_recorder import ResultRecorder
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.step_pipeline import StepPipeline
from rollout.engine.stop_checker import StopChecker
from rollout.errors import InvalidRequest
from rollout.forward.forward_batch import ForwardMode

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self, options: EngineOptions, runner: ModelRunner, stop_checker: StopChecker
    ) -> None:
        self.options = options.scheduler
        self.runner = runner
        self.stop_checker = stop_checker
        no_cache = options.cache.disable_radix_cache
        self.kv = KVManager(runner.num_slots, runner.req_to_token, no_cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # mid-prefill; continues first in the next prefill
        self.weight_version = "default"
        self.weight_updates = 0  # weight changes committed, named or not (labels may repeat)
        # Why stepping is held (generation paused, memory released, ...): requests wait meanwhile.
        self.holds: set[str] = set()
        # Steps in flight applied early with requests left to run: each held their next launch.
        self.drains = 0
        ratio = NewTokenRatio(self.options.schedule_conservativeness)
        self.prefill = PrefillPlanner(self.options, self.kv, ratio)
        self.decode = DecodePlanner(self.kv, ratio)
        self.results = ResultRecorder(self.kv, stop_checker)
        # Requests whose grammar (json_schema, regex, ...) compiles before they may run.
        self.grammars = GrammarQueue(self._grammar_backend)
        self.pipeline = StepPipeline(
            runner, self.kv, not self.options.disable_overlap_schedule,
            on_launch=self._launched, on_results=self._apply, on_failure=self._fail,
        )  # fmt: skip

    @property
    def in_flight(self) -> LaunchedStep | None:  # launched, results not applied yet
        return self.pipeline.in_flight

    @property
    def stats(self) -> dict[str, int | float]:
        return {
            "prompt_tokens": self.prefill.prompt_tokens,
            "cached_tokens": self.prefill.cached_tokens,
            "generated_tokens": self.results.generated_tokens,
            "retractions": self.decode.retractions,
            "pipeline_drains": self.drains,
            "device_busy_s": self.pipeline.busy.seconds,
        }

    @property
    def device_busy_by_step(self) -> dict[str, dict[str, float]]:
        """device_busy_s by step kind (extend, decode by batch-size bucket), with step counts."""
        return self.pipeline.busy.by_kind

    # ---- inputs ---------------------------------------------------------------------------
    def add_request(self, treq: TokenizedRequest) -> None:
        try:
            budget = self.runner.context_length - len(treq.input_ids)
            max_new = 0 if treq.embed else min(treq.params.max_new_tokens, max(budget, 0))
            req = Req(req=treq, max_new_tokens=max_new)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            logger.exception("request %s could not be queued", treq.rid)
            # Reported under its rid, with nothing of the request that failed to be read.
            req = Req(req=TokenizedRequest(treq.rid, [], SamplingParams(), 0), max_new_tokens=0)
            self.results.finish(req, failure_reason("queuing the request", e))
            return
        if treq.lora_name is not None and not self._on_adapter(req):
            return
        if req.req.params.grammar is not None and not treq.embed:
            self._compile_grammar(req)
            return
        self.waiting.append(req)

    def _on_adapter(self, req: Req) -> bool:
        """Gives a request on a LoRA adapter its prefix-cache namespace; refuses it (False)
        when no adapter of that name is loaded."""
        try:
            lora = self._lora()
            lora.check_request(req.req.lora_name)
        except InvalidRequest as e:
            self.results.finish(req, {"type": "invalid_request", "message": str(e)})
            return False
        req.cache_namespace = lora.namespace(req.req.lora_name)
        return True

    def _lora(self) -> LoraManager:
        if self.runner.lora is None:
            raise InvalidRequest(
                "this engine serves no LoRA adapters: start it with enable_lora (or lora_paths)"
            )
        return self.runner.lora

    def lora_call(self, call: LoadLoraAdapter | UnloadLoraAdapter) -> dict:
        """Loads or unloads an adapter between steps (drained by the caller)."""
        lora = self._lora()
        if isinstance(call, LoadLoraAdapter):
            return lora.load(call.lora_name, call.lora_path, call.allowed_roots)
        return lora.unload(call.lora_name, [r.req.lora_name for r in self._live()])

    def abort(self, msg: AbortRequest) -> None:
        self.drain()
        for req in self._live():
            by_rid = msg.rid is not None and msg.rid in (req.rid, req.req.group_rid)
            if msg.abort_all or by_rid or _in_session(req, msg.session_id):
                self.results.finish(req, {"type": "abort", "message": "aborted by request"})
        self._drop_finished()
        if msg.session_id is not None:  # close_session: its turns are over, its KV unpinned
            self.kv.close_session(msg.session_id)

    def _drop_finished(self) -> None:
        """Takes finished requests out of the queue, the running list and the chunked slot."""
        self.waiting = deque(r for r in self.waiting if not r.finished)
        self.running = [r for r in self.running if not r.finished]
        if self.chunked is not None and self.chunked.finished:
            self.chunked = None

    def _live(self) -> list[Req]:
        chunk = [self.chunked] if self.chunked is not None else []
        return [*self.waiting, *self.running, *chunk, *self.grammars.reqs()]

    def has_requests(self) -> bool:
        """Are requests queued, mid-prefill or running? (Not counting the step in flight.)"""
        return bool(self.waiting or self.running or self.chunked)

    def has_work(self) -> bool:
        busy = self.waiting or self.running or self.chunked or self.pipeline.in_flight
        return bool(busy or self.grammars)

    def can_step(self) -> bool:
        """Would `step` do anything? (A held scheduler still applies the batch in flight.)"""
        return self.pipeline.in_flight is not None or (self.has_work() and not self.holds)

    def flush_cache(self) -> dict:
        self.drain()
        if self.has_work():
            busy = "cannot flush the cache while requests are running"
            return {"success": False, "message": busy}
        self.kv.flush()
        return {"success": True, "message": ""}

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Launches the next batch if there is work, then applies the batch launched by the
        previous step (without overlap: this one). Returns the requests with something to report."""
        if self.grammars:
            self._admit_compiled()
        if self.pipeline.must_drain_first():
            self.drain()
        batch = None
        if not self.holds:
            batch = self._plan()
            # Nothing fits and nothing in flight will free KV: what sessions keep must yield,
            # a session at a time, until something fits.
            stalled = batch is None and self.has_requests() and self.pipeline.in_flight is None
            while stalled and self.kv.yield_pins():
                batch = self._plan()
                stalled = batch is None
        self.pipeline.push(batch)
        return self.take_reports()

    def drain(self) -> None:
        """Applies the batch in flight, if any. Afterwards every sampled token is on the host,
        each running request's KV covers all but its newest token, and the device is done."""
        if self.pipeline.in_flight is not None and self.has_requests():
            self.drains += 1  # the next launch waits for this step's results
        self.pipeline.drain()

    def take_reports(self) -> list[Req]:
        """The requests with something to report since the last call (finished, or streaming)."""
        return self.results.take_reports()

    def _grammar_backend(self) -> GrammarBackend:
        if self.runner.tp.size > 1:
            raise InvalidRequest("grammars (json_schema, regex, ...) need tp_size 1 for now")
        checker = self.stop_checker
        eos = sorted(checker.eos_token_ids)
        return GrammarBackend(checker.tokenizer, self.runner.vocab_size, eos)

    def _compile_grammar(self, req: Req) -> None:
        try:
            self.grammars.add(req)
        except InvalidRequest as e:  # the caller's 400: this engine can't constrain outputs
            self.results.finish(req, {"type": "invalid_request", "message": str(e)})
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            logger.exception("request %s: its grammar could not be compiled", req.rid)
            self.results.finish(req, failure_reason("compiling its grammar", e))

    def _admit_compiled(self) -> None:
        """Requests whose grammar compiled join the queue; those whose grammar failed end."""
        idle = not (self.waiting or self.running or self.chunked or self.pipeline.in_flight)
        ready, failed = self.grammars.take_ready(idle)
        self.waiting.extend(ready)
        for req, error in failed:
            self.results.finish(req, failure_reason("compiling its grammar", error))

    def _plan(self) -> ScheduleBatch | None:
        return self.prefill.plan(self.chunked, self.waiting, self.running) or self._plan_decode()

    def _plan_decode(self) -> ScheduleBatch | None:
        if self.kv.free_slots() < len(self.running):
            self.drain()  # requests that finished in the batch in flight free their KV first
        return self.decode.plan(self.running, self.waiting, self._last_token_in_flight())

    def _last_token_in_flight(self) -> set[int]:
        """The running requests (by id) whose token in the step in flight is their last
        (max_new_tokens): a decode for them now would compute a token nobody gets."""
        step = self.pipeline.in_flight
        if step is None:
            return set()
        batch = step.batch
        return {
            id(r)
            for r, samples in zip(batch.reqs, batch.sampling)
            if samples and r.at_max_new_tokens(pending=1)
        }

    def _launched(self, batch: ScheduleBatch) -> None:
        """After the batch is queued on the device: advances what planning the next batch reads
        (KV lengths, the prefix cache, the chunked and running requests)."""
        if batch.mode is ForwardMode.DECODE:
            self.decode.launched(batch)
        else:
            self.chunked = self.prefill.launched(batch, self.running)

    def _apply(self, batch: ScheduleBatch, outs: list[ReqStepOutput]) -> None:
        # NOTE: running requests are all unfinished between steps: only a finish here changes that.
        if self.results.record(batch, outs):
            self._drop_finished()

    def _fail(self, req: Req, reason: dict) -> None:
        self.results.finish(req, reason)
        self._drop_finished()

    # ---- calls from outside the step loop ---------------------------------------------------
    def retract_all(self) -> int:
        """Puts every running and mid-prefill request back at the head of the queue, in order,
        releasing its KV; each re-prefills (from the cache while it lasts) once stepping resumes.
        Returns how many were retracted."""
        self.drain()
        reqs = [*self.running, *([self.chunked] if self.chunked is not None else [])]
        self.running, self.chunked = [], None
        for req in reversed(reqs):
            self.kv.release(req)
            self.waiting.appendleft(req)
        return len(reqs)

    def publish_weight_version(self, version: str, weights_changed: bool) -> None:
        """From the next step on, outputs carry `version`. A request that already computed
        something records where the version changed; with new weights, no request attached
        later reuses KV computed before (live requests keep theirs and continue in place)."""
        self.drain()
        self._pin_unreported_versions()
        for req in self._live():
            if req.output_ids or req.kv_len:
                change = {"offset": len(req.output_ids), "weight_version": version}
                change["previous"] = self.weight_version  # for meta_info.weight_versions spans
                if req.req.lora_name is not None:  # labelled by its adapter's version: kept
                    change["weight_version"] = change["previous"] = self.version_of(req)
                req.version_changes.append(change)
        if weights_changed:
            self.kv.invalidate_cache(self._live())
            self.weight_updates += 1
        self.weight_version = version

    def publish_adapter_version(self, name: str, version: str | None) -> str:
        """After weight sync wrote new values of LoRA adapter `name`: its label becomes
        `version` (None: kept) and its KV a new cache namespace. A request on it that already
        computed something records where the version changed and keeps its KV (as for the
        base model's updates); one holding no KV (queued, retracted) attaches under the new
        namespace. Returns the label."""
        self.drain()
        self._pin_unreported_versions()
        lora = self._lora()
        previous = lora.version_of(name)
        label = lora.publish(name, version)
        for req in self._live():
            if req.req.lora_name != name:
                continue
            if req.output_ids or req.kv_len:
                change = {"offset": len(req.output_ids), "weight_version": label}
                req.version_changes.append({**change, "previous": previous})
            if req.row is None:
                req.cache_namespace = lora.namespace(name)
        return label

    def _pin_unreported_versions(self) -> None:
        """Before a version change: requests that finished under the current version (aborted
        by the call that changes it, or by the step just drained) and are yet to be reported
        keep that version in their outputs."""
        for req in self.results.to_report:
            if req.finished and req.finished_version is None:
                req.finished_version = self.version_of(req)

    def version_of(self, req: Req) -> str:
        """The weight version a request's outputs carry: its LoRA adapter's, else the base
        model's (for a finished request, the one it finished under)."""
        if req.finished_version is not None:
            return req.finished_version
        name, lora = req.req.lora_name, self.runner.lora
        if name is None or lora is None or not lora.is_loaded(name):
            return self.weight_version
        return lora.version_of(name)

    def make_output(self, req: Req) -> ReqOutput:
        """The request's news since its last output; clears what it reports."""
        return req.take_output(self.version_of(req))

    def server_info(self) -> dict:
        return {
            "num_running": len(self.running) + (1 if self.chunked else 0),
            "num_waiting": len(self.waiting),
            "max_total_tokens": self.runner.num_slots,
            "context_length": self.runner.context_length,
            "weight_version": self.weight_version,
            "weight_updates": self.weight_updates,
            "kv_whole": not self.has_work() and self.kv.is_whole(),
            **(self.runner.lora.info() if self.runner.lora is not None else {}),
            "time": time.time(),
            **self.kv.usage(),
            **self.stats,
            "device_busy_by_step": self.device_busy_by_step,
            # The scheduler process's heap (heap.py): what its collections skip, and cost.
            "heap_frozen_objects": frozen_objects(),
            **collector_time().info(),
        }


def _in_session(req: Req, session_id: str | None) -> bool:
    params = req.req.session_params
    return session_id is not None and params is not None and params.id == session_id
