"""y = x @ W^T (+ bias) for a few rows of x: the projections of a small decode batch.

With one to a few tokens a linear layer only streams its weight, so its time is the weight's
bytes over the memory bandwidth reached. A library GEMM picks tiles made for many rows: for
Qwen2.5-7B's q/k/v (3584 -> 4608) and o (3584 -> 3584) projections at batch 1 it starts fewer
programs than the GPU has SMs. Here each program owns BLOCK_N output features over the whole K
and every program streams its rows of W once; the rows of x (at most BLOCK_M) ride along.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rollout_kernels.pdl import launch_options, pdl_start
from rollout_kernels.precision import dot_precision

MAX_ROWS = 16  # x rows one launch takes; more rows are a job for a real GEMM


@functools.cache
def _shared_memory(device_index: int) -> int | None:
    """Bytes of shared memory one program may use on the GPU (its opt-in maximum); None where
    torch does not say."""
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", None)


def fit_stages(
    block_n: int, block_k: int, num_stages: int, element_size: int, device: torch.device,
    x_rows: int = MAX_ROWS,
) -> int:
    """num_stages, lowered (to 1 at least) until the pipeline fits in `device`'s shared memory.
    Triton's pipeline of num_stages keeps num_stages - 1 slices in flight, each a block_k wide
    slice of W's block_n features and of x's `x_rows` rows: a balanced launch's wider tiles at
    the engine's 5 stages (64 features of Qwen2.5-7B's q/k/v a program) would ask an H100 for
    320 KiB."""
    if device.type != "cuda":
        return num_stages
    index = device.index if device.index is not None else torch.cuda.current_device()
    limit = _shared_memory(index)
    stage = block_k * (block_n + x_rows) * element_size
    while limit and num_stages > 1 and (num_stages - 1) * stage > limit:
        num_stages -= 1
    return num_stages


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K, COLS_PER,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BALANCED: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < M
    if BALANCED:  # this program's COLS_PER (<= BLOCK_N) output features
        cols = pid * COLS_PER + tl.arange(0, BLOCK_N)
        cmask = (cols < (pid + 1) * COLS_PER) & (cols < N)
    else:
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + ks < K
        w_t = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 + ks)[:, None],
            mask=kmask[:, None] & cmask[None, :], other=0.0,
        )  # [BLOCK_K, BLOCK_N]: W's rows as columns
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :],
            mask=rmask[:, None] & kmask[None, :], other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        acc += tl.dot(x, w_t, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows[:, None] * stride_ym + cols[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=rmask[:, None] & cmask[None, :],
    )


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int = 32,
    block_k: int = 256,
    num_warps: int = 4,
    num_stages: int = 4,
    programs: int | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS, weight: [N, K], bias: [N] or None, all one dtype;
    the last dim of x and weight contiguous. Returns [M, N] = x @ weight.T + bias in x's dtype,
    accumulated in float32.

    Each program owns block_n output features; with `programs` the features are instead split
    evenly over that many programs (block_n then the power of two that holds a share), so that
    a launch of one program an SM keeps every SM streaming to the end: N / block_n programs
    may be a wave and a few (Qwen2.5-7B's q/k/v: 144 tiles of 32 for 132 SMs).

    The tiles are sized for 2-byte elements: with 4-byte ones block_k is halved, so that each
    pipeline stage takes the same shared memory (float32 at block_k 512 and 5 stages asks an
    H100 for 384 KiB of its 227), and it never exceeds K rounded up to a power of two."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(
            f"skinny_gemm needs x [M, K], weight [N, K], bias [N]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, bias {None if bias is None else tuple(bias.shape)}"
        )
    if m > MAX_ROWS:
        raise ValueError(f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("skinny_gemm needs the last dim of x and weight contiguous")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if x.element_size() > 2:
        block_k //= 2
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if programs is None:
        cols_per, grid = block_n, triton.cdiv(n, block_n)
    else:
        if programs < 1:
            raise ValueError(f"skinny_gemm needs programs >= 1, got {programs}")
        cols_per = triton.cdiv(n, programs)
        block_n, grid = max(16, triton.next_power_of_2(cols_per)), triton.cdiv(n, cols_per)
    num_stages = fit_stages(block_n, block_k, num_stages, x.element_size(), x.device)
    _skinny_gemm_kernel[(grid,)](
        x, weight, bias if bias is not None else weight, y,
        m, n, k, cols_per,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype), BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        BALANCED=programs is not None,
        num_warps=num_warps, num_stages=num_stages, **launch_options(x),
    )
    return y
