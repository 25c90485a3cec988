"""LogprobHead: the logprobs a step returns, queued on the device without waiting.

For each row whose request returns logprobs (a prompt token it scores, or the token just
sampled): the chosen token's logprob, the top-k, and the logprobs of the ids the request named.
Logprobs are of the model's distribution, not the sampler's: they are read from the logits
before sampling penalizes them in place.

Two ways to read them: the [L, V] log-softmax of the scored rows, taken before sampling; or
(`read_once`, on a GPU with the Triton kernels) each row's logsumexp, computed in one read of
its logits, with logprob = logit - logsumexp for just the entries returned. The second writes
no [L, V] tensor, but reads the logits after sampling, so a step takes it only when no scored
row belongs to a request whose sampling changes its logits in place (penalties, logit_bias,
bans, a grammar). Deterministic inference keeps the log-softmax: its trainer-side model
computes logprobs the same way, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.device_ints import to_device
from rollout.engine.launched_step import LogitRow
from rollout.engine.req import Req


@dataclass
class ScoredRows:
    """What a step's logprobs are read from: [L, V] `values` of the scored rows, logprobs
    themselves or (with `lse`, [L]) logits that give logprobs less their row's lse."""

    values: torch.Tensor
    lse: torch.Tensor | None = None


class LogprobHead:
    def __init__(self, device: torch.device, read_once: bool = False) -> None:
        self.device = device
        self.read_once = read_once

    @staticmethod
    def rows_of(reqs: list[Req], rows: list[LogitRow]) -> list[int]:
        """Which of `rows` return logprobs."""
        wants = [reqs[row.req].req.return_logprob and row.kind != "pool" for row in rows]
        return [k for k, want in enumerate(wants) if want]

    def score(
        self, reqs: list[Req], rows: list[LogitRow], logits: torch.Tensor, lp_rows: list[int]
    ) -> ScoredRows:
        """Before sampling: logits [R, V] float32, not yet penalized; what rows `lp_rows`'
        logprobs are read from."""
        scored = logits if len(lp_rows) == len(logits) else logits[to_device(lp_rows, self.device)]
        if self.read_once and not any(reqs[rows[k].req].changes_logits for k in lp_rows):
            from rollout_kernels.row_logsumexp import row_logsumexp

            return ScoredRows(scored, row_logsumexp(scored))
        return ScoredRows(torch.log_softmax(scored, dim=-1))

    def queue(
        self, reqs: list[Req], rows: list[LogitRow], lp_rows: list[int], sample_rows: list[int],
        scored: ScoredRows, tokens: torch.Tensor | None, out: dict[str, torch.Tensor],
    ) -> None:  # fmt: skip
        """Queues chosen, top_values / top_ids and id_logprobs (named as in LaunchedStep) into
        `out`. scored: `score`'s for rows `lp_rows`; tokens: [S] sampled at `sample_rows`."""
        values, lse = scored.values, scored.lse
        dev = self.device
        # Each row's logprob is of the prompt token it scores, or of the token just sampled.
        if lp_rows == sample_rows:
            assert tokens is not None
            targets = tokens
        else:
            prompt_ids = [rows[k].target if rows[k].kind == "prompt" else 0 for k in lp_rows]
            targets = to_device(prompt_ids, dev)
            where = {k: j for j, k in enumerate(sample_rows)}
            sampled = [(j, where[k]) for j, k in enumerate(lp_rows) if rows[k].kind == "sample"]
            if sampled:
                assert tokens is not None
                dst, src = zip(*sampled)
                targets[to_device(list(dst), dev)] = tokens[to_device(list(src), dev)]
        chosen = values.gather(1, targets[:, None]).squeeze(1)
        out["chosen"] = chosen if lse is None else chosen - lse
        lp_reqs = [reqs[rows[k].req].req for k in lp_rows]
        top_k = min(max(r.top_logprobs_num for r in lp_reqs), values.shape[-1])
        if top_k > 0:
            top_values, out["top_ids"] = values.topk(top_k, dim=-1)
            out["top_values"] = top_values if lse is None else top_values - lse[:, None]
        pairs = [(j, t) for j, r in enumerate(lp_reqs) for t in r.token_ids_logprob or ()]
        if pairs:
            at, ids = to_device([j for j, _ in pairs], dev), to_device([t for _, t in pairs], dev)
            picked = values[at, ids]
            out["id_logprobs"] = picked if lse is None else picked - lse[at]
