"""Random paged KV layouts and a plain float64 attention reference for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [slots, Hkv, D]
    v_cache: torch.Tensor
    req_to_token: torch.Tensor  # [rows, max_context] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    extend_lens: torch.Tensor  # [B] int64
    extend_starts: torch.Tensor  # [B] int64
    q: torch.Tensor  # [T, H, D], T = sum(extend_lens)


def make_paged_batch(
    seq_lens: list[int],
    extend_lens: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
) -> PagedBatch:
    """Every request's keys sit in scattered slots (slot 0 stays unused, as in the pool) and in
    a table row that is not its batch index, so kernels that ignore the indirection fail."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    slots = torch.randperm(total + 7, generator=gen)[:total] + 1
    rows = torch.randperm(len(seq_lens) + 3, generator=gen)[: len(seq_lens)]
    max_context = max(seq_lens) + 5
    table = torch.zeros(len(seq_lens) + 3, max_context, dtype=torch.int64)
    used = 0
    for row, n in zip(rows.tolist(), seq_lens):
        table[row, :n] = slots[used : used + n]
        used += n
    shape = (total + 8, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(extend_lens), heads, dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *extend_lens[:-1]]).cumsum(0)

    def put(x: torch.Tensor) -> torch.Tensor:
        return x.to(device)

    return PagedBatch(
        put(k_cache), put(v_cache), put(table), put(rows), put(torch.tensor(seq_lens)),
        put(torch.tensor(extend_lens)), put(starts), put(q),
    )


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """[T, H, D] float64 on the CPU, computed where the batch lives: each new token attends
    to keys 0..its own position."""
    q = batch.q.double()
    heads, kv_heads = q.shape[1], batch.k_cache.shape[1]
    out = torch.empty_like(q)
    start = 0
    for b, (n, ext) in enumerate(zip(batch.seq_lens.tolist(), batch.extend_lens.tolist())):
        slots = batch.req_to_token[batch.req_pool_indices[b], :n]
        keys = batch.k_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        values = batch.v_cache[slots].double().repeat_interleave(heads // kv_heads, dim=1)
        query = q[start : start + ext]  # [E, H, D]
        scores = torch.einsum("ehd,nhd->hen", query, keys) * scale
        q_pos = torch.arange(n - ext, n, device=q.device)
        future = torch.arange(n, device=q.device)[None, :] > q_pos[:, None]  # [E, N]
        scores = scores.masked_fill(future, float("-inf"))
        out[start : start + ext] = torch.einsum("hen,nhd->ehd", scores.softmax(-1), values)
        start += ext
    return out.cpu()
