"""SamplingHead: one token per "sample" row of a step, drawn on the device without waiting.

Each token is also stored as its request's `last_token` (by req->token row): the input of the
request's next decode, which may be launched before the token reaches the host.
"""

from __future__ import annotations

import torch

from rollout.engine.device_ints import to_device
from rollout.engine.grammar_mask import mask_logits
from rollout.engine.launched_step import LogitRow
from rollout.engine.req import Req
from rollout.engine.sampler import SamplingBatch, sample
from rollout.forward.kernel_plan import KernelPlan


class SamplingHead:
    def __init__(
        self, eos_token_ids: list[int], last_token: torch.Tensor, kernel_plan: KernelPlan
    ) -> None:
        self.eos_token_ids = eos_token_ids
        self.last_token = last_token  # [rows of the req->token table] int64, the runner's
        self.kernel_plan = kernel_plan  # says which batches sample on the Triton kernel
        self.device = last_token.device

    def sample(
        self, reqs: list[Req], rows: list[LogitRow], logits: torch.Tensor,
        table_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Samples `rows` (all "sample" rows of the batch of `reqs`) and stores each token as
        its request's `last_token`. logits: [S, V] float32, row k for rows[k]; penalized in
        place. table_rows: [S] the requests' req->token rows on the device, when the caller has
        them. Returns [S] int64 token ids on the device.
        Before: a request with sampling penalties has all its earlier tokens in output_ids."""
        sreqs = [reqs[row.req] for row in rows]
        # Tokens generated before this one: those on the host plus any still on the device.
        steps = [row.target - len(r.prompt_ids) for row, r in zip(rows, sreqs)]
        for r, n in zip(sreqs, steps):
            assert not r.penalizes or len(r.output_ids) == n, (
                f"{r.rid}: penalties need its {n} output tokens on the host; "
                f"{len(r.output_ids)} are"
            )
        sampling = SamplingBatch.build(
            [r.req.params for r in sreqs],
            [r.req.seed for r in sreqs],
            [r.output_ids for r in sreqs],
            [r.prompt_ids for r in sreqs],
            self.eos_token_ids,
            logits.shape[-1],
            self.device,
            steps=steps,
            per_filter_set=self.kernel_plan.sampling_per_filter_set,
        )
        constrained = [k for k, r in enumerate(sreqs) if r.grammar is not None]
        if constrained:
            self._mask_grammars(logits, sreqs, constrained)
        kernel = self.kernel_plan.samples_with_kernel(len(rows), sampling.filtered)
        tokens = sample(logits, sampling, kernel)
        if table_rows is None:
            table_rows = to_device([r.row for r in sreqs], self.device)
        self.last_token[table_rows] = tokens
        return tokens

    @staticmethod
    def _mask_grammars(logits: torch.Tensor, sreqs: list[Req], constrained: list[int]) -> None:
        """Forbids, in the rows `constrained`, the tokens their grammars don't allow next (each
        grammar first takes the request's tokens since its last step: all on the host)."""
        grammars = []
        for k in constrained:
            grammar = sreqs[k].grammar
            assert grammar is not None
            grammar.advance(sreqs[k].output_ids)
            grammars.append(grammar)
        mask_logits(logits, constrained, grammars)
