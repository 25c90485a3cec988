"""LaunchedStep.outputs: what each request gets from a step's device results, whichever path
(the per-row walk, or the shortcuts for rows that are all plain samples) hands them out."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rollout.engine.launched_step import LaunchedStep, LogitRow, ReqStepOutput


def _step(reqs: list[SimpleNamespace], rows: list[LogitRow], **tensors) -> LaunchedStep:
    batch = SimpleNamespace(reqs=[SimpleNamespace(req=r) for r in reqs])
    outs = [ReqStepOutput() for _ in reqs]
    return LaunchedStep(batch, rows, outs, {k: torch.tensor(v) for k, v in tensors.items()})


def _req(**kw) -> SimpleNamespace:
    fields = dict(return_logprob=True, top_logprobs_num=0, token_ids_logprob=None, return_hidden_states=False)
    return SimpleNamespace(**{**fields, **kw})


def test_sampled_tokens_with_logprobs_match_the_per_row_walk():
    reqs = [_req() for _ in range(3)]
    rows = [LogitRow(i, "sample", 10 + i) for i in range(3)]
    tokens, chosen = [7, 8, 9], [-0.5, -1.25, -2.0]
    fast = _step(reqs, rows, tokens=tokens, chosen=chosen).outputs()
    # An empty hidden-states tensor (no request asked for them) sends the step down the walk.
    walked = _step(reqs, rows, tokens=tokens, chosen=chosen, hidden=torch.empty(0, 4)).outputs()
    assert fast == walked
    assert [(o.next_token, o.token_logprob) for o in fast] == [(7, (-0.5, 7)), (8, (-1.25, 8)), (9, (-2.0, 9))]
    assert all(o.top_logprobs is None and o.token_ids_logprobs is None for o in fast)


def test_prompt_rows_keep_their_scored_tokens_beside_the_sample():
    # One request scores two prompt tokens and samples one: chosen has a row more than tokens.
    reqs = [_req()]
    rows = [LogitRow(0, "prompt", 4), LogitRow(0, "prompt", 5), LogitRow(0, "sample", 3)]
    out = _step(reqs, rows, tokens=[6], chosen=[-0.5, -0.25, -0.125]).outputs()[0]
    assert out.input_token_logprobs == [(-0.5, 4), (-0.25, 5)]
    assert (out.next_token, out.token_logprob) == (6, (-0.125, 6))


def test_rows_without_logprobs_beside_rows_with_them():
    reqs = [_req(return_logprob=False), _req()]
    rows = [LogitRow(0, "sample", 3), LogitRow(1, "sample", 3)]
    outs = _step(reqs, rows, tokens=[1, 2], chosen=[-0.75]).outputs()
    assert (outs[0].next_token, outs[0].token_logprob) == (1, None)
    assert (outs[1].next_token, outs[1].token_logprob) == (2, (-0.75, 2))
