"""PrefillPlanner: which queued requests (and prompt chunks) the next prefill computes.

Admission takes requests from the front of the queue, in order, while the step's token budget
(chunked_prefill_size, max_prefill_tokens), max_running_requests and the KV pool allow. The
pool must keep room for the tokens the running and admitted requests are yet to generate
(NewTokenRatio). The request mid-prefill (chunked) goes first; only the last request of a
prefill may stop part way, and it continues first in the next one.

After `plan`: each planned request holds a req->token row, its longest cached prefix (locked)
and slots for this step's tokens, written to its row; admitted requests have left `waiting`.
A request that could not get slots was released again (it holds nothing) and stays queued.
Once the batch is launched (`launched`), its requests join `running` or stay mid-prefill.
What they hold is freed when they finish (ResultRecorder.finish) or are retracted.
"""

from __future__ import annotations

from collections import deque

import torch

from rollout.config import SchedulerOptions
from rollout.engine.kv_manager import KVManager
from rollout.engine.new_token_ratio import NewTokenRatio
from rollout.engine.req import Req, ScheduleBatch
from rollout.forward.forward_batch import ForwardMode

# Requests in one prefill whose next uncomputed tokens agree on this many ids share them:
# all but the first wait a step and take the KV from the cache (n samples of one prompt).
SHARED_HEAD = 16


class PrefillPlanner:
    def __init__(self, options: SchedulerOptions, kv: KVManager, ratio: NewTokenRatio) -> None:
        self.options = options
        self.kv = kv
        self.ratio = ratio
        self.prompt_tokens = 0  # of admitted requests, counted once (not on re-prefill)
        self.cached_tokens = 0  # of those, found in the prefix cache

    def plan(
        self, chunked: Req | None, waiting: deque[Req], running: list[Req]
    ) -> ScheduleBatch | None:
        """The next prefill: `chunked` (mid-prefill) first, then requests admitted from the
        front of `waiting` (which this removes them from); None if nothing fits."""
        if chunked is None and not waiting:
            return None
        budget = min(self.options.chunked_prefill_size, self.options.max_prefill_tokens)
        reqs: list[Req] = []
        lens: list[int] = []
        slots = []
        # The running requests' future tokens: summed once a new request needs them.
        reserve: int | None = None
        candidates = ([chunked] if chunked is not None else []) + list(waiting)
        for req in candidates:
            if budget <= 0:
                break
            is_new = req is not chunked
            if is_new:
                if len(running) + len(reqs) >= self.options.max_running_requests:
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
                    reserve = sum(self.ratio.future_tokens(r) for r in running)
                reserve += self.ratio.future_tokens(req)
                room -= reserve
            ext = min(remaining, budget, room)
            got = self.kv.allocate(req, ext) if ext > 0 else None
            if got is None:
                if is_new:
                    self.kv.release(req)
                break
            if is_new:
                waiting.remove(req)
                if not req.output_ids:
                    self.prompt_tokens += len(req.prompt_ids)
                    self.cached_tokens += req.kv_len
            reqs.append(req)
            lens.append(ext)
            slots.append(got)
            budget -= ext
            if ext < remaining:  # only the last request of a prefill may be a partial chunk
                break
        if not reqs:
            return None
        return ScheduleBatch(ForwardMode.EXTEND, reqs, lens, torch.cat(slots))

    def launched(self, batch: ScheduleBatch, running: list[Req]) -> Req | None:
        """The prefill is queued on the device: each request's new tokens count as computed
        and go to the prefix cache; a request that completed its prompt joins `running` (it
        decodes next, from the token sampled on the device) unless it only wanted its prompt
        computed. Returns the request that stopped part way, to continue first next time."""
        chunked = None
        for i, (req, ext) in enumerate(zip(batch.reqs, batch.extend_lens)):
            req.kv_len += ext
            self.kv.insert_computed(req)
            if not batch.samples(i):
                chunked = req
                continue
            req.input_logprobs_done = True
            if req.max_new_tokens > 0:
                running.append(req)
        return chunked

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
