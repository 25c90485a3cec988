"""Sampling per filter set (deterministic inference): a row's draw the same bits whatever else is
in its batch.

The sampling kernel runs a pass for each filter the batch uses (top-k, top-p, min-p), over every
row: a row without top-p still runs the top-p pass when another row has one, and its bits then
depend on its neighbours. Here each set of filters among the rows gets a launch of its own, with
that set's passes only (one launch for the usual batch, whose rows share their parameters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from rollout.engine.sampler import SamplingBatch

# The bits of SamplingBatch.filter_sets.
FILTER_TOP_K, FILTER_TOP_P, FILTER_MIN_P = 1, 2, 4


def row_filter_sets(top_ks: np.ndarray, top_ps: np.ndarray, min_ps: np.ndarray, vocab: int) -> np.ndarray:
    """[B] uint8: the filters each row uses, from its top_k (vocab: none), top_p and min_p."""
    return (
        np.where(top_ks < vocab, FILTER_TOP_K, 0)
        | np.where(top_ps < 1.0, FILTER_TOP_P, 0)
        | np.where(min_ps > 0.0, FILTER_MIN_P, 0)
    ).astype(np.uint8)


def sample_per_filter_set(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """logits: [B, V] float32, already penalized; batch built per_filter_set. Returns [B] int64
    token ids: a kernel launch per filter set; greedy rows take the argmax, as alone."""
    from rollout_kernels.sampling import sample_tokens

    per_row = (
        batch.temperatures.reshape(-1), batch.greedy, batch.top_ks, batch.top_ps, batch.min_ps,
        batch.seeds, batch.steps,
    )  # fmt: skip

    def draw(rows_logits: Tensor, per_row: tuple[Tensor, ...], filters: int) -> Tensor:
        return sample_tokens(
            rows_logits, *per_row, use_top_k=bool(filters & FILTER_TOP_K),
            use_top_p=bool(filters & FILTER_TOP_P), use_min_p=bool(filters & FILTER_MIN_P),
        )  # fmt: skip

    sets = np.unique(batch.filter_sets)
    if len(sets) == 1:
        tokens = draw(logits, per_row, int(sets[0]))
    else:
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        for filters in sets.tolist():
            rows = np.flatnonzero(batch.filter_sets == filters)
            index = torch.from_numpy(rows).to(logits.device, non_blocking=True)
            tokens[index] = draw(logits[index], tuple(t[index] for t in per_row), filters)
    if batch.any_greedy:
        tokens = torch.where(batch.greedy, logits.argmax(dim=-1), tokens)
    return tokens
