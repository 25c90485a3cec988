"""RequestGrammar: where one request's output stands in its grammar, and which tokens may come
next.

The matcher is advanced lazily: before each constrained sampling step it takes the output
tokens it has not seen yet. A request with a grammar has its tokens on the host before its next
step is planned (Req.penalizes), so the mask is always that of the newest token.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.engine.grammar_spec import import_xgrammar


class RequestGrammar:
    def __init__(self, compiled: Any, vocab_size: int) -> None:
        xgr = import_xgrammar()
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.accepted = 0  # output tokens the matcher has taken

    def advance(self, output_ids: list[int]) -> None:
        """Feeds the output tokens not fed yet. Raises RuntimeError on a token the grammar
        forbids (the mask makes that a bug, never the model's doing)."""
        for token in output_ids[self.accepted :]:
            if not self.matcher.accept_token(token):
                raise RuntimeError(
                    f"token {token} at output position {self.accepted} breaks the grammar"
                )
            self.accepted += 1

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of bitmask ([R, ceil(V / 32)] int32,
        host; bit j of word w allows token 32 w + j). Once the grammar is complete only the
        EOS ids are allowed."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        """Has the grammar taken its end (an EOS id)?"""
        return self.matcher.is_terminated()
