"""LogprobHead: the logprobs a step returns, queued on the device without waiting.

For each row whose request returns logprobs (a prompt token it scores, or the token just
sampled): the chosen token's logprob, the top-k, and the logprobs of the ids the request named.
The log-softmax is taken before sampling, which penalizes the logits in place: logprobs are of
the model's distribution, not the sampler's.
"""

from __future__ import annotations

import torch

from rollout.engine.device_ints import to_device
from rollout.engine.launched_step import LogitRow
from rollout.engine.req import Req


class LogprobHead:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    @staticmethod
    def rows_of(reqs: list[Req], rows: list[LogitRow]) -> list[int]:
        """Which of `rows` return logprobs."""
        wants = [reqs[row.req].req.return_logprob and row.kind != "pool" for row in rows]
        return [k for k, want in enumerate(wants) if want]

    def log_softmax(self, logits: torch.Tensor, lp_rows: list[int]) -> torch.Tensor:
        """logits: [R, V] float32, not yet penalized. Returns [L, V] logprobs of rows `lp_rows`."""
        scored = logits if len(lp_rows) == len(logits) else logits[to_device(lp_rows, self.device)]
        return torch.log_softmax(scored, dim=-1)

    def queue(
        self, reqs: list[Req], rows: list[LogitRow], lp_rows: list[int], sample_rows: list[int],
        logprobs: torch.Tensor, tokens: torch.Tensor | None, out: dict[str, torch.Tensor],
    ) -> None:  # fmt: skip
        """Queues chosen, top_values / top_ids and id_logprobs (named as in LaunchedStep) into
        `out`. logprobs: [L, V] of rows `lp_rows`; tokens: [S] sampled at `sample_rows`."""
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
        out["chosen"] = logprobs.gather(1, targets[:, None]).squeeze(1)
        lp_reqs = [reqs[rows[k].req].req for k in lp_rows]
        top_k = min(max(r.top_logprobs_num for r in lp_reqs), logprobs.shape[-1])
        if top_k > 0:
            out["top_values"], out["top_ids"] = logprobs.topk(top_k, dim=-1)
        pairs = [(j, t) for j, r in enumerate(lp_reqs) for t in r.token_ids_logprob or ()]
        if pairs:
            at, ids = zip(*pairs)
            out["id_logprobs"] = logprobs[to_device(list(at), dev), to_device(list(ids), dev)]
