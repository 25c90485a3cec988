"""One forward batch over a test's KV pool: the extend of seqs[i][cached[i]:] on top of KV that
already holds seqs[i][:cached[i]] (request i in row i of the req->token table)."""

from __future__ import annotations

from typing import Any

import torch

from rollout.forward.attention import create_attention_backend
from rollout.forward.forward_batch import ForwardBatch, ForwardMode


def forward_batch(
    kv: Any, table: Any, seqs: list[list[int]], cached: list[int],
    mode: ForwardMode = ForwardMode.EXTEND, backend: Any = None, device: str = "cpu",
) -> ForwardBatch:  # fmt: skip
    """The batch, its attention backend prepared (torch's unless `backend` is given)."""
    ids, pos, loc = [], [], []
    for i, (seq, c) in enumerate(zip(seqs, cached)):
        ids += seq[c:]
        pos += range(c, len(seq))
        loc += table.read(i, c, len(seq)).tolist()
    seq_lens = [len(s) for s in seqs]
    extend_lens = [len(s) - c for s, c in zip(seqs, cached)]
    fb = ForwardBatch(
        mode=mode,
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(pos, device=device),
        out_cache_loc=torch.tensor(loc, device=device),
        req_pool_indices=torch.arange(len(seqs), device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        extend_lens=torch.tensor(extend_lens, device=device),
        req_to_token=table.table,
        kv_pool=kv,
        attn_backend=backend or create_attention_backend("torch"),
        seq_lens_cpu=seq_lens,
        extend_lens_cpu=extend_lens,
    )
    fb.attn_backend.prepare(fb)
    return fb
