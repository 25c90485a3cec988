"""Batch-invariant GEMM: out = x @ weight.T (+ bias), where a row's result does not depend on
how many other rows are multiplied with it, nor on where in the batch (or in a tile) it sits.

Every launch uses one tiling, whatever the number of rows: one program per [BLOCK_M, BLOCK_N]
output tile, walking K in BLOCK_K steps from 0 upwards with no split-K, so each output element
is the same sum in the same order in every batch. torch's GEMMs pick their kernel (and with it
the summation order) by the problem's shape, which is what makes a request's logits depend on
what else was batched with it.

On the GPU the tile products run on tensor cores (tl.dot), which treat every element of a tile
alike. Under Triton's interpreter tl.dot is a BLAS call whose result for a column can depend on
the column's place in the tile, so there the product is a broadcast multiply and a sum over K
in order: slow, but the same for every row and column.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.precision import dot_precision


# do_not_specialize: Triton would otherwise compile other code for M == 1 or M % 16 == 0.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr,
    M, N, K, K_CHUNK,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CHUNKS: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < M
    cmask = cols < N
    # K in CHUNKS fixed pieces of K_CHUNK: each summed from zero, the pieces then added in
    # order, here (SPLIT off) or by _sum_parts_kernel from the partial sums that the programs
    # along axis 2 write (SPLIT on): the same additions either way.
    first = tl.program_id(2) if SPLIT else 0
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for chunk in range(first, first + (1 if SPLIT else CHUNKS)):
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(chunk * K_CHUNK, tl.minimum(chunk * K_CHUNK + K_CHUNK, K), BLOCK_K):
            kk = k0 + ks
            kmask = kk < K
            a = tl.load(
                x_ptr + rows[:, None] * stride_xm + kk[None, :],
                mask=rmask[:, None] & kmask[None, :], other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            w = tl.load(
                w_ptr + cols[:, None] * stride_wn + kk[None, :],
                mask=cmask[:, None] & kmask[None, :], other=0.0,
            )  # [BLOCK_N, BLOCK_K], read along the weight's contiguous rows
            b = tl.trans(w)  # [BLOCK_K, BLOCK_N]
            # NOTE: tile products are written out here, not in a helper: the interpreter spends
            # more on each call of a jit function than on the product itself.
            if USE_DOT:
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            else:  # each element summed over K in order, wherever it sits in the tile
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        if CHUNKS == 1:
            total = acc  # one piece: its sum as it is
        else:
            total += acc
    if SPLIT:
        offs = (first * M).to(tl.int64) * N + rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + offs, total, mask=rmask[:, None] & cmask[None, :])
        return
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out_offs = rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _sum_parts_kernel(
    part_ptr, b_ptr, out_ptr, M, N, stride_om,
    HAS_BIAS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """out = the CHUNKS partial sums added in order (+ bias), as _gemm_kernel adds them."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for chunk in range(0, CHUNKS):
        offs = (chunk * M).to(tl.int64) * N + rows[:, None] * N + cols[None, :]
        total += tl.load(part_ptr + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    out_offs = rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptr + out_offs, total.to(out_ptr.dtype.element_ty), mask=mask)


def gemm_tiles(device: torch.device, dtype: torch.dtype) -> dict[str, int]:
    """The one tiling used on `device` for operands of `dtype`: a function of those two only,
    never of the shape, so that every batch runs the same kernel."""
    if device.type != "cuda":  # the interpreter: few, large tiles
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}
    if dtype == torch.float32:  # float32 tiles take twice the shared memory
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}


def batch_invariant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    tiles: dict[str, int] | None = None,
    k_chunks: int = 1,
    split: bool = False,
) -> torch.Tensor:
    """x: [M, K], weight: [N, K] (rows contiguous), bias: [N] or None -> [M, N] in out_dtype
    (default x's dtype), accumulated in float32. `out` (a [M, N] view whose rows may be strided,
    e.g. columns of a wider buffer) receives the result instead of a new tensor. `tiles`
    (default gemm_tiles') is for benchmarks: a row's result is invariant under any one tiling,
    not across tilings. So are `k_chunks` (K summed in that many fixed pieces, then the pieces
    in order: a row's result depends on it) and `split` (the pieces on programs of their own,
    for few rows: the same result as without)."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"batch_invariant_linear needs x [M, K] and weight [N, K], got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"batch_invariant_linear needs bias of shape ({n},), got {tuple(bias.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    if out is None:
        out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(-1) != 1:
        raise ValueError(f"batch_invariant_linear needs out [{m}, {n}] with contiguous rows, got {tuple(out.shape)}")
    if m == 0 or n == 0:
        return out
    tiles = tiles or gemm_tiles(x.device, x.dtype)
    if k_chunks < 1:
        raise ValueError(f"batch_invariant_linear needs k_chunks >= 1, got {k_chunks}")
    k_chunk = triton.cdiv(triton.cdiv(k, k_chunks), tiles["BLOCK_K"]) * tiles["BLOCK_K"]
    chunks = triton.cdiv(k, k_chunk) if k else 1
    split = split and chunks > 1
    parts = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split else out
    grid = (triton.cdiv(m, tiles["BLOCK_M"]), triton.cdiv(n, tiles["BLOCK_N"]), chunks if split else 1)
    bias_or_any = weight if bias is None else bias
    _gemm_kernel[grid](
        x, weight, bias_or_any, out, parts,
        m, n, k, k_chunk,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, USE_DOT=x.is_cuda, DOT_PRECISION=dot_precision(x.dtype),
        CHUNKS=chunks, SPLIT=split, **tiles,
    )  # fmt: skip
    if split:
        block_m, block_n = tiles["BLOCK_M"], tiles["BLOCK_N"]
        _sum_parts_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
            parts, bias_or_any, out, m, n, out.stride(0),
            HAS_BIAS=bias is not None, CHUNKS=chunks, BLOCK_M=block_m, BLOCK_N=block_n,
        )  # fmt: skip
    return out
