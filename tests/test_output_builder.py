"""A streamed request's logprob entries are made once each, and every output's lists are its own."""

from __future__ import annotations

import asyncio

from rollout.engine.messages import LogprobColumns
from rollout.engine.output_builder import LogprobEntries


def _columns(positions: range) -> LogprobColumns:
    cols = LogprobColumns()
    for p in positions:
        cols.add_token((-0.5 * p, p), [(-0.1 * p, p), (-0.2 * p, p + 1)], None)
    return cols


def test_each_update_makes_the_new_positions_and_earlier_outputs_stay_as_they_were():
    texts: list[int] = []

    def text_of(token_id: int) -> str:
        texts.append(token_id)
        return f"t{token_id}"

    entries, total = LogprobEntries(text_of), _columns(range(3))
    first = asyncio.run(entries.update(total))
    total.extend(_columns(range(3, 5)))
    second = asyncio.run(entries.update(total))
    assert second == total.entries(text_of)  # the same as making them all at once
    assert len(first["output_token_logprobs"]) == 3 and len(second["output_token_logprobs"]) == 5
    assert first["output_top_logprobs"][2] == [(-0.2, 2, "t2"), (-0.4, 3, "t3")]
    # Made once each: 3 + 2 positions of 3 entries, then the whole columns again for the check.
    assert len(texts) == 3 * 5 + 3 * 5
