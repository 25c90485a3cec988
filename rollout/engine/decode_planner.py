"""DecodePlanner: one token for every running request, retracting the newest when KV is short.

Before `plan`: every running request is unfinished and holds KV for all but its newest token;
the caller has applied the step in flight if the pool looked short (its finished requests
freed their KV). After: each running request holds one more slot, for its newest token, written
to its req->token row at position kv_len (kv_len itself advances at launch: `launched`). A
retracted request releases all its KV (its computed prefix stays in the radix cache while it
lasts) and goes back to the head of the queue, to be prefilled again.
"""

from __future__ import annotations

import logging
from collections import deque

from rollout.engine.kv_manager import KVManager
from rollout.engine.new_token_ratio import NewTokenRatio
from rollout.engine.req import Req, ScheduleBatch
from rollout.forward.forward_batch import ForwardMode

logger = logging.getLogger(__name__)


class DecodePlanner:
    def __init__(self, kv: KVManager, ratio: NewTokenRatio) -> None:
        self.kv = kv
        self.ratio = ratio
        self.retractions = 0

    def plan(
        self, running: list[Req], waiting: deque[Req], finishing: set[int] = frozenset()
    ) -> ScheduleBatch | None:
        """The decode batch of `running`, after retracting (from its end, the newest) into the
        front of `waiting` until the pool has a slot for each; None if none is left to decode.
        `finishing`: ids of requests whose token in flight is their last, left out (they stay
        running until that step's results finish them)."""
        retracted = False
        while running and self.kv.free_slots() < len(running):
            self._retract(running.pop(), waiting, len(running))
            retracted = True
        if retracted:
            self.ratio.raise_after_retraction(running)
        else:
            self.ratio.decay()
        reqs = [r for r in running if id(r) not in finishing]
        if not reqs:
            return None
        slots = self.kv.allocate_decode(reqs)
        assert slots is not None  # free_slots() >= len(running) was just ensured
        return ScheduleBatch(ForwardMode.DECODE, reqs, [1] * len(reqs), slots)

    @staticmethod
    def launched(batch: ScheduleBatch) -> None:
        """The batch is queued on the device: its tokens count as computed for planning."""
        for req in batch.reqs:
            req.kv_len += 1

    def _retract(self, req: Req, waiting: deque[Req], still_running: int) -> None:
        self.kv.release(req)
        waiting.appendleft(req)
        self.retractions += 1
        logger.info("retracted %s: KV pool full (%d running)", req.rid, still_running)
