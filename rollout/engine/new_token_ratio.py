"""NewTokenRatio: how much KV admission keeps free for the tokens requests are yet to generate.

Admission keeps free `value` x each running (and newly admitted) request's remaining
max_new_tokens (at most CLIP_MAX_NEW of them). The ratio starts at RATIO_INIT x
schedule_conservativeness, decays linearly to RATIO_MIN_FACTOR x that over RATIO_DECAY_STEPS
decode steps (requests mostly stop early), and jumps back up when a retraction shows it was
too low. The prefill planner reads it; the decode planner moves it.
"""

from __future__ import annotations

import math

from rollout.engine.req import Req

RATIO_INIT = 0.7
RATIO_MIN_FACTOR = 0.14
RATIO_DECAY_STEPS = 600
CLIP_MAX_NEW = 4096
# A retraction assumes the requests still running decode at least this many more tokens.
RETRACT_DECODE_STEPS = 20


class NewTokenRatio:
    def __init__(self, schedule_conservativeness: float) -> None:
        self.init = min(RATIO_INIT * schedule_conservativeness, 1.0)
        self.min = min(self.init * RATIO_MIN_FACTOR, 1.0)
        self.decay_step = (self.init - self.min) / RATIO_DECAY_STEPS
        self.value = self.init

    def future_tokens(self, req: Req) -> int:
        """KV that admission keeps free for `req`'s tokens still to come."""
        remaining = req.max_new_tokens - len(req.output_ids)
        if remaining <= 0:
            return 0
        return math.ceil(min(remaining, CLIP_MAX_NEW) * self.value)

    def decay(self) -> None:
        """One decode step planned without a retraction."""
        self.value = max(self.min, self.value - self.decay_step)

    def raise_after_retraction(self, running: list[Req]) -> None:
        """Requests were just retracted; `running` are those kept. The ratio becomes at least
        what they have generated, plus RETRACT_DECODE_STEPS more each, over what they may
        generate in all."""
        if not running:
            self.value = max(self.value, self.init)
            return
        decoded = sum(len(r.output_ids) for r in running)
        most = sum(r.max_new_tokens for r in running)
        needed = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(running)) / max(most, 1))
        self.value = max(self.value, needed)
