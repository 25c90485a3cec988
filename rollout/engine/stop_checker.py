"""Decides, after each sampled token, whether a request stops (EOS, stop ids, stop strings)."""

from __future__ import annotations

from typing import Any

from rollout.engine.req import DECODE_CONTEXT_TOKENS, Req
from rollout.engine.token_text import decode_options, text_after

# A stop string of L characters ends within the last L + TAIL_SLACK tokens (byte-level
# tokens may carry partial characters).
TAIL_SLACK = 8


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)

    def check(self, req: Req) -> dict[str, Any] | None:
        """The finish reason if req's newest token ends it, else None. min_new_tokens is the
        sampler's job (it bans stop tokens until then), so a stop token here always stops."""
        params = req.req.params
        token = req.output_ids[-1]
        if not params.ignore_eos and token in self.eos_token_ids:
            return {"type": "stop", "matched": token}
        if params.stop_token_ids and token in params.stop_token_ids:
            return {"type": "stop", "matched": token}
        if params.stop and len(req.output_ids) >= params.min_new_tokens:
            longest = max(len(s) for s in params.stop)
            tail = self._tail(req, longest + TAIL_SLACK)
            for stop in params.stop:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None

    def _tail(self, req: Req, tokens: int) -> str:
        """The text of the output's last `tokens` tokens, decoded with the request's options as
        the detokenizer decodes its text; from the output's start, what they add after the
        prompt's last tokens (a decoder may drop a text's first space)."""
        kw = decode_options(req.req.params)
        window = req.output_ids[-tokens:]
        if len(window) == len(req.output_ids):
            text = text_after(self.tokenizer, req.prompt_ids[-DECODE_CONTEXT_TOKENS:], window, **kw)
            if text is not None:
                return text
        return self.tokenizer.decode(window, **kw)
