"""Row-wise logsumexp of float32 logits, reading them once: the normalizer of a row's logprobs
(logprob(t) = logit(t) - logsumexp(row)) without writing the [R, V] log-softmax.

Each row is cut into chunks of CHUNK columns, each chunk taken by a program of its own (so a
few rows of a large vocabulary still spread over the GPU), which keeps a running max and a
sum of exp(x - max) over its chunk; a second launch combines each row's chunks. A row whose
every entry is -inf gets -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _chunk_max_sum_kernel(
    x_ptr, stride_x, max_ptr, sum_ptr, V,
    NUM_CHUNKS: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row, chunk = tl.program_id(0), tl.program_id(1)
    row_ptr = x_ptr + row.to(tl.int64) * stride_x
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"))
        new_m = tl.maximum(m, x)
        # Lanes still at -inf (nothing finite seen) keep a sum of 0, not exp(-inf + inf).
        finite = new_m > float("-inf")
        safe = tl.where(finite, new_m, 0.0)
        s = tl.where(finite, s * tl.exp(m - safe) + tl.exp(x - safe), 0.0)
        m = new_m
    best = tl.max(m, axis=0)
    safe_best = tl.where(best > float("-inf"), best, 0.0)
    total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - safe_best), 0.0), axis=0)
    tl.store(max_ptr + row * NUM_CHUNKS + chunk, best)
    tl.store(sum_ptr + row * NUM_CHUNKS + chunk, total)


@triton.jit
def _combine_kernel(max_ptr, sum_ptr, out_ptr, NUM_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    live = c < NUM_CHUNKS
    m = tl.load(max_ptr + row * NUM_CHUNKS + c, mask=live, other=float("-inf"))
    s = tl.load(sum_ptr + row * NUM_CHUNKS + c, mask=live, other=0.0)
    best = tl.max(m, axis=0)
    safe = tl.where(best > float("-inf"), best, 0.0)
    total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - safe), 0.0), axis=0)
    tl.store(out_ptr + row, tl.where(best > float("-inf"), safe + tl.log(total), best))


def row_logsumexp(x: torch.Tensor, chunk: int = 8192, block: int = 1024) -> torch.Tensor:
    """x: [R, V] float32 with contiguous rows. Returns [R] float32 logsumexp of each row."""
    if x.dim() != 2 or x.dtype != torch.float32 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"row_logsumexp needs [R, V] float32 rows, got {tuple(x.shape)} {x.dtype} with "
            f"strides {x.stride()}"
        )
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out
    block = min(block, triton.next_power_of_2(max(vocab, 16)))
    chunk = triton.cdiv(max(chunk, block), block) * block  # whole blocks per chunk
    chunks = max(1, triton.cdiv(vocab, chunk))
    maxes = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    sums = torch.empty_like(maxes)
    _chunk_max_sum_kernel[(rows, chunks)](
        x, x.stride(0), maxes, sums, vocab, NUM_CHUNKS=chunks, CHUNK=chunk, BLOCK=block, num_warps=4
    )
    _combine_kernel[(rows,)](maxes, sums, out, NUM_CHUNKS=chunks, BLOCK_C=triton.next_power_of_2(chunks))
    return out
