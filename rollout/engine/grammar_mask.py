"""Applies the requests' grammars to a step's logits: every token a row's grammar forbids next
gets -inf, before penalties, filters and the draw (so greedy and sampled rows alike obey it).

Rows without a grammar are untouched, and a batch without one never comes here.
"""

from __future__ import annotations

import torch

from rollout.engine.device_ints import to_device
from rollout.engine.grammar_matcher import RequestGrammar


def mask_logits(logits: torch.Tensor, rows: list[int], grammars: list[RequestGrammar]) -> None:
    """logits: [S, V] float32, changed in place; rows[k] is the row grammars[k] constrains."""
    n, V = len(rows), logits.shape[-1]
    words = (grammars[0].vocab_size + 31) // 32
    bitmask = torch.empty((n, words), dtype=torch.int32)  # host: the matchers write it
    for k, grammar in enumerate(grammars):
        grammar.fill(bitmask, k)
    device = logits.device
    bits = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(n, words * 32)[:, :V].bool()  # [n, V]
    # Logits wider than the grammar's vocabulary: the ids past it are never allowed.
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]), value=False)
    if n == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
        return
    index = to_device(rows, device)
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
