"""Scheduler: continuous batching over one ModelRunner.

Each step is either a prefill (new requests and chunks of long prompts, under a token budget)
or a decode (one token for every running request). Prefill goes first, as in SGLang. When
the KV pool runs dry during decode, the newest running requests are retracted to the front of
the queue and later re-prefilled (their computed KV stays in the prefix cache while it lasts).

Overlap: one batch stays in flight. A step plans and launches batch k, then applies batch k-1's
results (tokens, stops, outputs) while the device computes k. What planning reads (KV lengths,
slots, the prefix cache, which requests run) advances at launch; tokens and finishing at apply.
So a request that finished in k-1 may be in k: that token is dropped and its KV freed. A batch
whose requests have sampling penalties is applied before the next is planned (penalties read the
tokens so far); every call that changes requests or weights from outside `drain`s first.

Failures: an exception while adding a request, launching a batch or recording one request's
results finishes those requests with finish_reason {"type": "error"} (their KV freed, the
trace logged) and the scheduler serves on. One that no request explains (planning, waiting for
the device, a device that no longer works) propagates: the process reports it and exits.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque

import torch

from rollout.config import EngineOptions
from rollout.engine.kv_manager import KVManager
from rollout.engine.launched_step import LaunchedStep, ReqStepOutput
from rollout.engine.messages import AbortRequest, ReqOutput, TokenizedRequest, failure_reason
from rollout.engine.model_runner import ModelRunner
from rollout.engine.req import Req, ScheduleBatch
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.stop_checker import StopChecker
from rollout.forward.forward_batch import ForwardMode

logger = logging.getLogger(__name__)

# Admission keeps KV free for the tokens that running (and newly admitted) requests are
# still to generate: new_token_ratio x their remaining max_new_tokens (at most CLIP_MAX_NEW of
# them). The ratio starts at RATIO_INIT x schedule_conservativeness, decays linearly to
# RATIO_MIN_FACTOR x that over RATIO_DECAY_STEPS decode steps (requests mostly stop early), and
# jumps back up when a retraction shows it was too low.
RATIO_INIT = 0.7
RATIO_MIN_FACTOR = 0.14
RATIO_DECAY_STEPS = 600
CLIP_MAX_NEW = 4096
# A retraction assumes the requests still running decode at least this many more tokens.
RETRACT_DECODE_STEPS = 20
# Requests in one prefill whose next uncomputed tokens agree on this many ids share them:
# all but the first wait a step and take the KV from the cache (n samples of one prompt).
SHARED_HEAD = 16


class Scheduler:
    def __init__(self, options: EngineOptions, runner: ModelRunner, stop_checker: StopChecker) -> None:
        self.options = options.scheduler
        self.runner = runner
        self.stop_checker = stop_checker
        self.kv = KVManager(runner.num_slots, runner.req_to_token, options.cache.disable_radix_cache)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # mid-prefill; continues first in the next prefill
        self.in_flight: LaunchedStep | None = None  # launched, results not applied yet
        self.overlap = not options.scheduler.disable_overlap_schedule
        self.to_report: list[Req] = []  # finished, or streaming with new tokens
        self.weight_version = "default"
        # Why stepping is held (generation paused, memory released, ...): requests wait meanwhile.
        self.holds: set[str] = set()
        c = self.options.schedule_conservativeness
        self.init_ratio = min(RATIO_INIT * c, 1.0)
        self.min_ratio = min(self.init_ratio * RATIO_MIN_FACTOR, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        self.stats = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "retractions": 0}

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
            self._finish(req, failure_reason("queuing the request", e))
            return
        self.waiting.append(req)

    def abort(self, msg: AbortRequest) -> None:
        self.drain()
        for req in self._live():
            if msg.abort_all or req.rid == msg.rid:
                self._finish(req, {"type": "abort", "message": "aborted by request"})
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Takes finished requests out of the queue, the running list and the chunked slot."""
        self.waiting = deque(r for r in self.waiting if not r.finished)
        self.running = [r for r in self.running if not r.finished]
        if self.chunked is not None and self.chunked.finished:
            self.chunked = None

    def _live(self) -> list[Req]:
        chunk = [self.chunked] if self.chunked is not None else []
        return [*self.waiting, *self.running, *chunk]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.in_flight)

    def can_step(self) -> bool:
        """Would `step` do anything? (A held scheduler still applies the batch in flight.)"""
        return self.in_flight is not None or (self.has_work() and not self.holds)

    def flush_cache(self) -> dict:
        self.drain()
        if self.has_work():
            return {"success": False, "message": "cannot flush the cache while requests are running"}
        self.kv.flush()
        return {"success": True, "message": ""}

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Launches the next batch if there is work, then applies the batch launched by the
        previous step (without overlap: this one). Returns the requests with something to report."""
        if self.in_flight is not None and self._penalized(self.in_flight):
            self.drain()
        batch = None if self.holds else (self._plan_prefill() or self._plan_decode())
        previous, self.in_flight = self.in_flight, None  # planning may have drained it
        failed = None
        if batch is not None:
            try:
                launched = self.runner.launch(batch)
            except Exception as e:  # noqa: BLE001 - this batch's requests fail, not the engine
                failed = e
            else:
                self.in_flight = self._launched(batch, launched)
        if previous is not None:
            self._apply(previous)
        if failed is not None:
            self._fail_launch(batch, failed)  # after `previous`: its tokens are the requests' own
        if not self.overlap:
            self.drain()
        return self.take_reports()

    @staticmethod
    def _penalized(step: LaunchedStep) -> bool:
        """Penalties read the tokens so far: such requests' next step waits for this one."""
        return any(r.penalizes for r in step.batch.reqs)

    def drain(self) -> None:
        """Applies the batch in flight, if any. Afterwards every sampled token is on the host,
        each running request's KV covers all but its newest token, and the device is done."""
        step, self.in_flight = self.in_flight, None
        if step is not None:
            self._apply(step)

    def take_reports(self) -> list[Req]:
        """The requests with something to report since the last call (finished, or streaming)."""
        done, self.to_report = self.to_report, []
        return done

    def _plan_prefill(self) -> ScheduleBatch | None:
        if self.chunked is None and not self.waiting:
            return None
        budget = min(self.options.chunked_prefill_size, self.options.max_prefill_tokens)
        reqs: list[Req] = []
        lens: list[int] = []
        slots = []
        # The running requests' future tokens: summed once a new request needs them.
        reserve: int | None = None
        candidates = ([self.chunked] if self.chunked is not None else []) + list(self.waiting)
        for req in candidates:
            if budget <= 0:
                break
            is_new = req is not self.chunked
            if is_new:
                if len(self.running) + len(reqs) >= self.options.max_running_requests:
                    break
                if self._shares_head(req, reqs):
                    continue
                if not self.kv.attach(req):
                    break
                if req.cached_tokens == 0:
                    req.cached_tokens = req.kv_len
            remaining = len(req.ids) - req.kv_len
            room = self.kv.free_slots()
            if is_new:
                if reserve is None:
                    reserve = sum(self._future_tokens(r) for r in self.running)
                reserve += self._future_tokens(req)
                room -= reserve
            ext = min(remaining, budget, room)
            got = self.kv.allocate(req, ext) if ext > 0 else None
            if got is None:
                if is_new:
                    self.kv.release(req)
                break
            if is_new:
                self.waiting.remove(req)
                if not req.output_ids:
                    self.stats["prompt_tokens"] += len(req.prompt_ids)
                    self.stats["cached_tokens"] += req.kv_len
            reqs.append(req)
            lens.append(ext)
            slots.append(got)
            budget -= ext
            if ext < remaining:  # only the last request of a prefill may be a partial chunk
                break
        if not reqs:
            return None
        return ScheduleBatch(ForwardMode.EXTEND, reqs, lens, torch.cat(slots))

    @staticmethod
    def _shares_head(req: Req, batch: list[Req]) -> bool:
        """Would `req` compute the same next tokens as a request already in this prefill?"""
        if len(req.ids) <= 1:
            return False
        for other in batch:
            head = req.ids[other.kv_len : other.kv_len + SHARED_HEAD]
            if len(head) > 1 and other.ids[other.kv_len : other.kv_len + len(head)] == head:
                return True
        return False

    def _future_tokens(self, req: Req) -> int:
        """KV that admission keeps free for `req`'s tokens still to come."""
        remaining = req.max_new_tokens - len(req.output_ids)
        if remaining <= 0:
            return 0
        return math.ceil(min(remaining, CLIP_MAX_NEW) * self.new_token_ratio)

    def _plan_decode(self) -> ScheduleBatch | None:
        if self.kv.free_slots() < len(self.running):
            self.drain()  # requests that finished in the batch in flight free their KV first
        retracted = False
        while self.running and self.kv.free_slots() < len(self.running):
            self._retract(self.running.pop())
            retracted = True
        if retracted:
            self.new_token_ratio = max(self.new_token_ratio, self._retract_ratio())
        else:
            self.new_token_ratio = max(self.min_ratio, self.new_token_ratio - self.ratio_decay)
        if not self.running:
            return None
        slots = self.kv.allocate_decode(self.running)
        assert slots is not None  # free_slots() >= len(running) was just ensured
        return ScheduleBatch(ForwardMode.DECODE, list(self.running), [1] * len(self.running), slots)

    def _retract_ratio(self) -> float:
        """The ratio a retraction calls for: what the requests kept running have generated,
        plus RETRACT_DECODE_STEPS more each, over what they may generate in all."""
        if not self.running:
            return self.init_ratio
        decoded = sum(len(r.output_ids) for r in self.running)
        most = sum(r.max_new_tokens for r in self.running)
        return min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / max(most, 1))

    def _retract(self, req: Req) -> None:
        self.kv.release(req)
        self.waiting.appendleft(req)
        self.stats["retractions"] += 1
        logger.info("retracted %s: KV pool full (%d running)", req.rid, len(self.running))

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
        for req in self._live():
            if req.output_ids or req.kv_len:
                change = {"offset": len(req.output_ids), "weight_version": version}
                req.add_pending("weight_version_changes", change)
        if weights_changed:
            self.kv.invalidate_cache(self._live())
        self.weight_version = version

    # ---- launching and results --------------------------------------------------------------
    def _launched(self, batch: ScheduleBatch, step: LaunchedStep) -> LaunchedStep:
        """After the batch is queued on the device: advances what planning the next batch reads
        (KV lengths, the prefix cache, the chunked and running requests)."""
        if batch.mode is ForwardMode.DECODE:
            for req in batch.reqs:
                req.kv_len += 1
            return step
        self.chunked = None
        for i, (req, ext) in enumerate(zip(batch.reqs, batch.extend_lens)):
            req.kv_len += ext
            self.kv.insert_computed(req)
            if not batch.samples(i):
                self.chunked = req
                continue
            req.input_logprobs_done = True
            if req.max_new_tokens > 0:
                self.running.append(req)  # decodes next, from the token sampled on the device
        return step

    def _apply(self, step: LaunchedStep) -> None:
        """Records a launched batch's results: prompt logprobs, tokens, stops and finishes."""
        batch = step.batch
        outs = self.runner.resolve(step)
        finished = False
        for req, out, samples in zip(batch.reqs, outs, batch.sampling):
            if req.finished:  # finished by an earlier batch, or aborted: its token is dropped
                continue
            try:
                finished |= self._apply_one(req, out, samples)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                logger.exception("request %s failed recording its step's results", req.rid)
                self._finish(req, failure_reason("recording its results", e))
                finished = True
        # NOTE: running requests are all unfinished between steps: only a finish here changes that.
        if finished:
            self._drop_finished()

    def _apply_one(self, req: Req, out: ReqStepOutput, samples: bool) -> bool:
        """Records one request's results of a step; returns whether it finished."""
        if out.input_token_logprobs:
            self._record_prompt_logprobs(req, out)
        if not samples:
            return False
        if out.embedding is not None:
            req.add_pending("embedding", out.embedding)
        if req.max_new_tokens == 0:  # prefill only: prompt logprobs, no sampling
            self._finish(req, {"type": "length", "length": 0})
            return True
        return self._record_token(req, out)

    def _fail_launch(self, batch: ScheduleBatch, exc: Exception) -> None:
        """The batch failed to launch, with nothing in flight now. Unless the device itself no
        longer works (that raises), each request is launched alone and applied at once: only
        those that fail alone finish with an error."""
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
                self._apply(self._launched(one, launched))

    def _fail_alone(self, one: ScheduleBatch, exc: Exception) -> None:
        """A one-request step failed to launch: the slots planned for it are freed (its kv_len
        does not count them) and the request finishes with an error, unless the batch applied
        just before finished it."""
        self.kv.free_unused(one.out_cache_loc)
        req = one.reqs[0]
        if req.finished:
            return
        during = f"its {one.mode.name.lower()} step"
        logger.error("request %s failed: %s failed to launch", req.rid, during, exc_info=exc)
        self._finish(req, failure_reason(during, exc))
        self._drop_finished()

    def _record_prompt_logprobs(self, req: Req, out: ReqStepOutput) -> None:
        req.pending.setdefault("input_token_logprobs", []).extend(out.input_token_logprobs)
        req.pending.setdefault("input_top_logprobs", []).extend(out.input_top_logprobs)
        req.pending.setdefault("input_token_ids_logprobs", []).extend(out.input_token_ids_logprobs)

    def _record_token(self, req: Req, out: ReqStepOutput) -> bool:
        """Appends the sampled token; returns whether it finished the request."""
        token = out.next_token
        assert token is not None
        req.output_ids.append(token)
        self.stats["generated_tokens"] += 1
        if out.token_logprob is not None:
            req.add_pending("output_token_logprobs", out.token_logprob)
            req.add_pending("output_top_logprobs", out.top_logprobs)
            req.add_pending("output_token_ids_logprobs", out.token_ids_logprobs)
        if out.hidden_state is not None:
            req.add_pending("hidden_states", out.hidden_state)
        reason = self.stop_checker.check(req)
        if reason is None and len(req.output_ids) >= req.max_new_tokens:
            reason = {"type": "length", "length": len(req.output_ids)}
        if reason is not None:
            self._finish(req, reason)
            return True
        if req.req.stream:
            self.to_report.append(req)
        return False

    def _finish(self, req: Req, reason: dict) -> None:
        req.finish_reason = reason
        # NOTE: a running request's KV covers all but its newest token. A decode launched
        # before this finish was known computes that token's KV too: freed, not cached, so the
        # cache holds what it would without overlap. (A request failing before its sampled token
        # reached the host has KV beyond its known tokens: that goes the same way.)
        if req.row is not None:
            self.kv.truncate(req, max(req.prefix_len, len(req.ids) - 1))
        self.kv.release(req)
        self.to_report.append(req)

    def make_output(self, req: Req) -> ReqOutput:
        """The request's news since its last output; clears what it reports."""
        return req.take_output(self.weight_version)

    def server_info(self) -> dict:
        return {
            "num_running": len(self.running) + (1 if self.chunked else 0),
            "num_waiting": len(self.waiting),
            "max_total_tokens": self.runner.num_slots,
            "context_length": self.runner.context_length,
            "weight_version": self.weight_version,
            "kv_whole": not self.has_work() and self.kv.is_whole(),
            "time": time.time(),
            **self.kv.usage(),
            **self.stats,
        }
