"""LoRA shrink: y[t] = x[t] @ A[slot[t]]^T for the rows of a batch that use an adapter.

A holds one matrix per adapter slot, [slots, N, K], with N = parts x max_rank when a
projection group (QKV, gate/up) stacks the A of each of its projections: one launch then
shrinks for all of them. Rows past an adapter's rank are never read (its `ranks` entry): the
buffer may hold anything there, and y holds zeros there.

With few rows (decode) the grid over (row blocks, rank columns) is too small to stream A at
the memory's speed, so K is split over `split_k` programs, each writing its own float32
partial sum: y is [split_k, T, N] and the expand kernel adds the partials as it reads them
(no atomics, the same sums in the same order every run).

The launch settings follow the number of rows (`shrink_settings`): a CUDA graph captures one
launch per batch size, so each size may launch its own way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout_kernels.lora_segments import LONG_ROWS, LoraSegments, segment_rows
from rollout_kernels.pdl import launch_options, pdl_start
from rollout_kernels.precision import dot_precision

# Enough programs to keep a GPU's memory busy for one small shrink; split_k aims at this.
TARGET_PROGRAMS = 256
# A batch of at most this many token rows launches as a decode batch (both LoRA kernels).
DECODE_ROWS = 16
# The largest batch the tuned settings are for (the decode batches CUDA graphs capture); a
# longer prefill launches as the kernels did before they were tuned.
TUNED_ROWS = 256
# One batch size of each launch class: within a class both kernels launch the same way (their
# settings, the segments' block size and whether K is split), so a batch of each compiles every
# variant the engine launches.
LAUNCH_CLASS_ROWS = (1, DECODE_ROWS + 1, TUNED_ROWS + 1, LONG_ROWS + 1)


@dataclass(frozen=True)
class ShrinkSettings:
    """How lora_shrink launches for some number of rows."""

    block_n: int  # columns of y per program
    block_k: int  # K per tile, for 2-byte inputs (halved for 4-byte ones)
    max_split_k: int | None  # the most programs along K choose_split_k may give (None: its own)


def shrink_settings(rows: int) -> ShrinkSettings:
    """The engine's launch settings for a shrink of `rows` token rows, from a sweep of the
    kernels on real models' projections (benchmarks/bench_lora_kernels.py --sweep).

    A decode batch is one row block per slot: it splits K as far as choose_split_k goes and
    streams A in long K tiles. Past it, every row block reads x once per column tile, so the
    tiles are wider; K is still split as far as choose_split_k goes (with A read from HBM, as
    in an engine's step, a cap of 4 left the long-K down projection's shrink a few programs).
    A long prefill (past LONG_ROWS: blocks of 64 rows) has its own, one piece along K; a batch
    between TUNED_ROWS and LONG_ROWS keeps the untuned launch."""
    if rows <= DECODE_ROWS:
        return ShrinkSettings(block_n=16, block_k=256, max_split_k=None)
    if rows <= TUNED_ROWS:
        return ShrinkSettings(block_n=32, block_k=256, max_split_k=None)
    if rows > LONG_ROWS:
        return ShrinkSettings(block_n=64, block_k=256, max_split_k=1)
    return ShrinkSettings(block_n=16, block_k=128, max_split_k=None)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, y_ptr, ranks_ptr,
    order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr,
    N, K, R, K_PER_SPLIT,
    stride_xm, stride_as, stride_an, stride_ys, stride_ym,
    NUM_SLOTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    pid_m, pid_n, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, tokens, rmask = segment_rows(
        block_slot_ptr, block_first_ptr, block_rows_ptr, order_ptr, pid_m, BLOCK_M
    )
    if slot >= NUM_SLOTS:
        return
    rank = tl.load(ranks_ptr + slot)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # column c is row c % R of part c // R
    live = (cols < N) & (cols % R < rank)
    k_start = split * K_PER_SPLIT
    # A block of columns all past the rank reads nothing and stores zeros.
    k_stop = tl.where(tl.sum(live.to(tl.int32)) > 0, tl.minimum(k_start + K_PER_SPLIT, K), 0)
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        kmask = k0 + ks < k_stop
        x = tl.load(
            x_ptr + tokens[:, None].to(tl.int64) * stride_xm + (k0 + ks)[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        a_t = tl.load(
            a_base + cols[None, :] * stride_an + (k0 + ks)[:, None],
            mask=kmask[:, None] & live[None, :],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]: A's rows as columns
        acc += tl.dot(x, a_t, input_precision=DOT_PRECISION)
    tl.store(
        y_ptr + split * stride_ys + tokens[:, None].to(tl.int64) * stride_ym + cols[None, :],
        acc,
        mask=rmask[:, None] & (cols < N)[None, :],
    )


def choose_split_k(segments: LoraSegments, n: int, k: int, block_n: int, block_k: int) -> int:
    """Programs along K so that the live programs come near TARGET_PROGRAMS: many for a decode
    batch, one for a long prefill. Depends on shapes only, so a CUDA graph replays the same."""
    live = triton.cdiv(segments.num_tokens, segments.block_m) * triton.cdiv(n, block_n)
    return max(1, min(TARGET_PROGRAMS // max(live, 1), triton.cdiv(k, 2 * block_k)))


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    segments: LoraSegments,
    ranks: torch.Tensor,
    rank_stride: int | None = None,
    split_k: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """x: [T, K]; a: [S, N, K] (one dtype with x, last dim contiguous); segments: the rows of
    each slot (lora_segments); ranks: [S] int32, the rows of each part of A in use. N is parts
    x rank_stride (default N: one part). Returns float32 partial sums [split_k, T, N] with
    y = result.sum(0) for every row of an adapter slot; base-only rows are not written.
    Settings left None are shrink_settings(T)'s; split_k None is choose_split_k's, at most
    that max_split_k."""
    t, k = x.shape
    s, n = a.shape[:2]
    rank_stride = n if rank_stride is None else rank_stride
    if a.shape[2] != k or n % rank_stride or ranks.shape != (s,) or segments.num_slots != s:
        raise ValueError(
            f"lora_shrink needs x [T, K], a [S, parts x R, K], ranks [S] and segments of S slots; "
            f"got x {tuple(x.shape)}, a {tuple(a.shape)} (R {rank_stride}), ranks "
            f"{tuple(ranks.shape)}, segments of {segments.num_slots} slots"
        )
    if segments.num_tokens != t:
        raise ValueError(f"lora_shrink: segments are of {segments.num_tokens} rows, x has {t}")
    if x.stride(-1) != 1 or a.stride(-1) != 1:
        raise ValueError("lora_shrink needs the last dim of x and a contiguous")
    settings = shrink_settings(t)
    block_n = settings.block_n if block_n is None else block_n
    block_k = settings.block_k if block_k is None else block_k
    if x.element_size() > 2:
        block_k //= 2  # the same shared memory per stage as 2-byte tiles
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if split_k is None:
        split_k = choose_split_k(segments, n, k, block_n, block_k)
        split_k = min(split_k, settings.max_split_k or split_k)
    # Rows padded to a multiple of 16: the partials' stride is then divisible by 16 whatever
    # T is, and Triton, which specializes integer arguments on that, builds one variant for
    # every batch size of a launch class (the warm-up compiles one size of each).
    y = torch.empty((split_k, triton.cdiv(t, 16) * 16, n), dtype=torch.float32, device=x.device)
    y = y[:, :t]
    if t == 0:
        return y
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    grid = (segments.grid_blocks(), triton.cdiv(n, block_n), split_k)
    _lora_shrink_kernel[grid](
        x, a, y, ranks,
        segments.order, segments.block_slot, segments.block_first, segments.block_rows,
        n, k, rank_stride, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), y.stride(0), y.stride(1),
        NUM_SLOTS=s, DOT_PRECISION=dot_precision(x.dtype),
        BLOCK_M=segments.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **launch_options(x),
    )  # fmt: skip
    return y


def lora_shrink_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    slots: torch.Tensor,
    ranks: torch.Tensor | None = None,
    rank_stride: int | None = None,
) -> torch.Tensor:
    """The torch reference: [T, N] float32, x[t] @ a[slots[t]]^T for rows with a slot in
    [0, S), zeros for the others (base-only rows). With `ranks`, the rows of each part of A
    past its slot's rank count as zeros, as the kernel reads them."""
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    n = a.shape[1]
    for s in range(a.shape[0]):
        rows = slots == s
        a_s = a[s].float()
        if ranks is not None:
            in_rank = torch.arange(n, device=a.device) % (rank_stride or n) < ranks[s]
            a_s = a_s * in_rank[:, None]
        y[rows] = x[rows].float() @ a_s.T
    return y
