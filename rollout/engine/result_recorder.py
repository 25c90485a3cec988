"""ResultRecorder: writes each applied step's results into its requests, and finishes requests.

A step's results are recorded in batch order: prompt logprobs, the embedding of an embed
request, then the sampled token with its logprobs and hidden state, and the stop check. A
request that finished earlier (by an earlier step, or aborted) is skipped: its token is dropped.

`finish` frees a finishing request's KV: its slots past its known tokens are freed, the rest
goes to the radix cache, its req->token row back to the table. The finished request is queued
to report; the scheduler takes it out of its waiting and running lists afterwards.
"""

from __future__ import annotations

import logging

from rollout.engine.kv_manager import KVManager
from rollout.engine.launched_step import ReqStepOutput
from rollout.engine.messages import failure_reason
from rollout.engine.req import Req, ScheduleBatch
from rollout.engine.stop_checker import StopChecker

logger = logging.getLogger(__name__)


class ResultRecorder:
    def __init__(self, kv: KVManager, stop_checker: StopChecker) -> None:
        self.kv = kv
        self.stop_checker = stop_checker
        self.to_report: list[Req] = []  # finished, or streaming with new tokens
        self.generated_tokens = 0

    def record(self, batch: ScheduleBatch, outs: list[ReqStepOutput]) -> bool:
        """Records a resolved step (one output per request of `batch`, in order); returns
        whether it finished any request. A request whose results fail to record finishes
        with an error; the others go on."""
        finished = False
        for req, out, samples in zip(batch.reqs, outs, batch.sampling):
            if req.finished:  # finished by an earlier batch, or aborted: its token is dropped
                continue
            try:
                finished |= self._record_one(req, out, samples)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                logger.exception("request %s failed recording its step's results", req.rid)
                self.finish(req, failure_reason("recording its results", e))
                finished = True
        return finished

    def take_reports(self) -> list[Req]:
        """The requests with something to report since the last call (finished, or streaming)."""
        done, self.to_report = self.to_report, []
        return done

    def finish(self, req: Req, reason: dict) -> None:
        """Ends the request with `reason`: frees its KV and queues it to report."""
        req.finish_reason = reason
        # NOTE: a running request's KV covers all but its newest token. A decode launched
        # before this finish was known computes that token's KV too: freed, not cached, so the
        # cache holds what it would without overlap. (A request failing before its sampled token
        # reached the host has KV beyond its known tokens: that goes the same way.)
        if req.row is not None:
            self.kv.truncate(req, max(req.prefix_len, len(req.ids) - 1))
        self.kv.release(req)
        self.to_report.append(req)

    def _record_one(self, req: Req, out: ReqStepOutput, samples: bool) -> bool:
        """Records one request's results of a step; returns whether it finished."""
        if out.input_token_logprobs:
            self._record_prompt_logprobs(req, out)
        if not samples:
            return False
        if out.embedding is not None:
            req.embedding = out.embedding
        if req.max_new_tokens == 0:  # prefill only: prompt logprobs, no sampling
            self.finish(req, {"type": "length", "length": 0})
            return True
        return self._record_token(req, out)

    def _record_prompt_logprobs(self, req: Req, out: ReqStepOutput) -> None:
        assert req.logprobs is not None  # prompt logprobs are computed for return_logprob only
        req.logprobs.add_prompt(
            out.input_token_logprobs, out.input_top_logprobs, out.input_token_ids_logprobs
        )

    def _record_token(self, req: Req, out: ReqStepOutput) -> bool:
        """Appends the sampled token; returns whether it finished the request."""
        token = out.next_token
        assert token is not None
        req.output_ids.append(token)
        self.generated_tokens += 1
        if out.token_logprob is not None and req.logprobs is not None:
            req.logprobs.add_token(out.token_logprob, out.top_logprobs, out.token_ids_logprobs)
        if out.hidden_state is not None:
            req.hidden_states.append(out.hidden_state)
        reason = self.stop_checker.check(req)
        if reason is None and req.at_max_new_tokens():
            reason = {"type": "length", "length": len(req.output_ids)}
        if reason is not None:
            self.finish(req, reason)
            return True
        if req.req.stream:
            self.to_report.append(req)
        return False
