"""The token embedding and the LM head, split by vocabulary rows over the tensor-parallel group.

Rank r holds rows [r * rows, (r + 1) * rows) of the vocabulary with rows = ceil(vocab / size);
the last ranks' parts are padded with zero rows to that shape (so that every rank's logits
have the same width and gather into one tensor), and the padding is trimmed after gathering.
At size 1 there is no padding and no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout.forward.tensor_parallel import SINGLE, TPGroup, make_shard
from rollout.models.layers import logits_linear


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's vocabulary rows: ids outside them embed to zeros and the
    sum over the group (all-reduce) is every id's row."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        start, stop, rows = tp.padded_range(vocab)
        super().__init__(rows, hidden)
        self.tp, self.vocab_start, self.vocab_stop = tp, start, stop
        self.hf_shards = {"weight": make_shard(0, start, stop, vocab)}
        with torch.no_grad():
            self.weight[stop - start :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, hidden]
        if self.tp.size == 1:
            return super().forward(input_ids)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_stop)
        local = torch.where(inside, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~inside[:, None], 0.0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """The LM head's weight, this rank's vocabulary rows [rows, hidden] (zero padded); the
    logits come from `vocab_logits`."""

    def __init__(self, vocab: int, hidden: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        start, stop, rows = tp.padded_range(vocab)
        self.weight = nn.Parameter(torch.zeros(rows, hidden))
        self.hf_shards = {"weight": make_shard(0, start, stop, vocab)}


def vocab_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab: int, tp: TPGroup, skinny_rows: int = 0,
    invariant: bool = False,
) -> torch.Tensor:
    """hidden: [N, hidden] (the same on every rank), weight: this rank's vocabulary rows ->
    the full float32 logits [N, vocab] on every rank."""
    logits = logits_linear(hidden, weight, skinny_rows, invariant)
    if tp.size == 1:
        return logits
    full = tp.all_gather(logits, dim=-1)  # [N, size * rows]
    return full if full.shape[-1] == vocab else full[:, :vocab].contiguous()
