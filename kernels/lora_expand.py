"""LoRA expand: out[t] += scale[slot[t]] * y[t] @ B[slot[t]]^T for the rows that use an adapter.

One launch serves a whole projection group: the fused QKV (or gate/up) output is the columns
of its projections side by side, each with its own B rows, its own shrunk columns of y and its
own scale. B is [slots, N, R]: the B of every projection stacked along N exactly as the
group's output columns are, R the largest rank; part p reads y's columns p*R .. p*R + rank.
An adapter's columns of B (and of y) are read up to its rank rounded up to RANK_ALIGN when R
is a multiple of it, so that the loads are 16 bytes wide: B must be zero past each slot's rank
there (LoraLayer keeps it zero past the rank; the shrink writes zeros in y past it). y is the
shrink's float32 partial sums, [split_k, T, parts x R], added here as they are read. The launch
settings follow the number of rows (`expand_settings`), as the shrink's do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout_kernels.lora_segments import LONG_ROWS, LoraSegments, segment_rows
from rollout_kernels.lora_shrink import DECODE_ROWS, TUNED_ROWS
from rollout_kernels.pdl import launch_options, pdl_start
from rollout_kernels.precision import dot_precision

RANK_ALIGN = 16  # ranks read in steps of this many columns (where R is a multiple of it)


@dataclass(frozen=True)
class OutputParts:
    """The output columns of each projection of a group: part p is columns
    offsets[p] .. offsets[p + 1]. `offsets` lives on the device, made once per layer."""

    sizes: tuple[int, ...]
    offsets: torch.Tensor  # [P + 1] int32

    @classmethod
    def make(cls, sizes: Sequence[int], device: torch.device | str) -> OutputParts:
        bounds = [0]
        for size in sizes:
            bounds.append(bounds[-1] + size)
        return cls(tuple(sizes), torch.tensor(bounds, dtype=torch.int32, device=device))


@dataclass(frozen=True)
class ExpandSettings:
    """How lora_expand launches for some number of rows."""

    block_n: int  # output columns per tile
    num_warps: int
    n_tiles: int = 1  # column tiles one program walks (its y read once for all of them)
    num_stages: int | None = None  # software pipelining of the tile loop (None: Triton's)


def expand_settings(rows: int) -> ExpandSettings:
    """The engine's launch settings for an expand of `rows` token rows, from a sweep of the
    kernels on real models' projections (benchmarks/bench_lora_kernels.py --sweep).

    Every column tile of a row block reads that block's y (all its partials) again, so wide
    tiles pay; at up to 16 rows, 4 warps a tile of 256 columns (the sweep after the loads
    became 16 bytes wide). A long prefill (past LONG_ROWS: blocks of 64 rows) has its own; a
    batch between TUNED_ROWS and LONG_ROWS keeps the untuned launch."""
    if rows <= DECODE_ROWS:
        return ExpandSettings(block_n=256, num_warps=4, num_stages=2)
    if rows <= TUNED_ROWS:
        return ExpandSettings(block_n=256, num_warps=8)
    if rows > LONG_ROWS:
        return ExpandSettings(block_n=64, num_warps=4, n_tiles=8, num_stages=3)
    return ExpandSettings(block_n=64, num_warps=4)


@triton.jit
def read_rank(ranks_ptr, slot, RANK_ALIGN: tl.constexpr):
    """The columns of B and y to read for `slot`: its rank rounded up to RANK_ALIGN. A mask
    that ends on a multiple of 16 lets each thread load 16 bytes at once; one that may end
    anywhere loads element by element."""
    rank = tl.load(ranks_ptr + slot)
    return tl.multiple_of(tl.cdiv(rank, RANK_ALIGN) * RANK_ALIGN, RANK_ALIGN)


@triton.jit
def part_columns(offsets_ptr, part, offset, COL_ALIGN: tl.constexpr):
    """(first, end) of the output columns a program of projection `part` starts at (`offset`
    columns in) and must stay below. Every part starting on a multiple of COL_ALIGN lets the
    output rows load and store 16 bytes at once."""
    first = tl.multiple_of(tl.load(offsets_ptr + part), COL_ALIGN) + offset
    return first, tl.multiple_of(tl.load(offsets_ptr + part + 1), COL_ALIGN)


@triton.jit
def sum_partials(ptrs, stride_ys, SPLIT_K, mask):
    """The float32 sum of the SPLIT_K partials at ptrs + split * stride_ys: four loads issued
    before their sum, so that a program waits on one memory latency per four partials, not on
    each one after the other (a long-K shrink splits K 30 ways and more)."""
    y = tl.zeros(ptrs.shape, tl.float32)
    for s0 in range(0, SPLIT_K, 4):
        left = SPLIT_K - s0 + tl.zeros(mask.shape, tl.int32)  # partials from s0 on
        p0 = tl.load(ptrs + s0 * stride_ys, mask=mask, other=0.0)
        p1 = tl.load(ptrs + (s0 + 1) * stride_ys, mask=mask & (left > 1), other=0.0)
        p2 = tl.load(ptrs + (s0 + 2) * stride_ys, mask=mask & (left > 2), other=0.0)
        p3 = tl.load(ptrs + (s0 + 3) * stride_ys, mask=mask & (left > 3), other=0.0)
        y += (p0 + p1) + (p2 + p3)
    return y


@triton.jit(do_not_specialize=["SPLIT_K"])  # 1 or more within one launch class
def _lora_expand_kernel(
    y_ptr, b_ptr, out_ptr, ranks_ptr, scales_ptr, offsets_ptr,
    order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr,
    R, SPLIT_K,
    stride_ys, stride_ym, stride_bs, stride_bn, stride_om, stride_ss,
    NUM_SLOTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    N_TILES: tl.constexpr, ONE_R_BLOCK: tl.constexpr, RANK_ALIGN: tl.constexpr,
    COL_ALIGN: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_start(USE_PDL)
    pid_m, part, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, tokens, rmask = segment_rows(
        block_slot_ptr, block_first_ptr, block_rows_ptr, order_ptr, pid_m, BLOCK_M
    )
    first, n1 = part_columns(offsets_ptr, part, pid_n * (N_TILES * BLOCK_N), COL_ALIGN)
    if (slot >= NUM_SLOTS) | (first >= n1):
        return
    rank = read_rank(ranks_ptr, slot, RANK_ALIGN)
    scale = tl.load(scales_ptr + slot * stride_ss + part)
    rs = tl.arange(0, BLOCK_R)
    y_rows = y_ptr + tokens[:, None].to(tl.int64) * stride_ym + part * R
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs
    if ONE_R_BLOCK:
        # Every rank fits one block: y (its partials summed) is read once for all the tiles.
        in_rank = rs < rank
        y = sum_partials(y_rows + rs[None, :], stride_ys, SPLIT_K, rmask[:, None] & in_rank[None, :])
        y = y.to(b_ptr.dtype.element_ty)
    for tile in range(N_TILES):
        cols = first + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < n1
        b_base = b_slot + cols[None, :].to(tl.int64) * stride_bn
        if ONE_R_BLOCK:
            b_t = tl.load(
                b_base + rs[:, None], mask=in_rank[:, None] & cmask[None, :], other=0.0
            )  # [BLOCK_R, BLOCK_N]: B's rows as columns
            acc = tl.dot(y, b_t, input_precision=DOT_PRECISION)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                in_chunk = r0 + rs < rank
                yc = sum_partials(
                    y_rows + (r0 + rs)[None, :], stride_ys, SPLIT_K, rmask[:, None] & in_chunk[None, :]
                )
                b_t = tl.load(
                    b_base + (r0 + rs)[:, None], mask=in_chunk[:, None] & cmask[None, :], other=0.0
                )
                acc += tl.dot(yc.to(b_t.dtype), b_t, input_precision=DOT_PRECISION)
        ptrs = out_ptr + tokens[:, None].to(tl.int64) * stride_om + cols[None, :]
        mask = rmask[:, None] & cmask[None, :]
        base = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (base + acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand(
    y: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    segments: LoraSegments,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    parts: OutputParts,
    block_n: int | None = None,
    num_warps: int | None = None,
    n_tiles: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """y: [split_k, T, P x R] float32 (lora_shrink's result); b: [S, N, R] with its last dim
    contiguous; out: [T, N] in b's dtype (or float32: the delta alone, unrounded), last dim
    contiguous, added to in place and returned;
    ranks: [S] int32; scales: [S, P] float32; parts: the P column ranges of out (summing to N).
    Rows of base-only tokens are left as they are. Settings left None are expand_settings(T)'s
    (num_stages: Triton's default when both are None)."""
    s, n, r = b.shape
    split_k, t = y.shape[:2]
    p = len(parts.sizes)
    if (
        y.shape[2] != p * r
        or out.shape != (t, n)
        or sum(parts.sizes) != n
        or ranks.shape != (s,)
        or scales.shape != (s, p)
        or segments.num_slots != s
        or segments.num_tokens != t
    ):
        raise ValueError(
            f"lora_expand needs y [split, T, P x R], b [S, N, R], out [T, N], ranks [S], "
            f"scales [S, P], parts summing to N and segments of T rows and S slots; got y "
            f"{tuple(y.shape)}, b {tuple(b.shape)}, out {tuple(out.shape)}, ranks "
            f"{tuple(ranks.shape)}, scales {tuple(scales.shape)}, parts {parts.sizes}, segments "
            f"of {segments.num_tokens} rows and {segments.num_slots} slots"
        )
    if y.dtype != torch.float32 or y.stride(-1) != 1:
        raise ValueError("lora_expand needs y as lora_shrink returns it: float32, contiguous")
    if out.stride(-1) != 1 or b.stride(-1) != 1 or scales.stride(-1) != 1:
        raise ValueError("lora_expand needs the last dim of out, b and scales contiguous")
    if t == 0:
        return out
    settings = expand_settings(t)
    block_n = settings.block_n if block_n is None else block_n
    num_warps = settings.num_warps if num_warps is None else num_warps
    n_tiles = settings.n_tiles if n_tiles is None else n_tiles
    num_stages = settings.num_stages if num_stages is None else num_stages
    if n_tiles < 1:
        raise ValueError(f"lora_expand needs n_tiles >= 1, got {n_tiles}")
    block_r = min(64, max(16, triton.next_power_of_2(r)))
    grid = (segments.grid_blocks(), p, triton.cdiv(max(parts.sizes), block_n * n_tiles))
    launch = {} if num_stages is None else {"num_stages": num_stages}
    align = RANK_ALIGN if r % RANK_ALIGN == 0 else 1  # rounding up stays inside B's rows
    col_align = 16 if all(size % 16 == 0 for size in parts.sizes) else 1
    _lora_expand_kernel[grid](
        y, b, out, ranks, scales, parts.offsets,
        segments.order, segments.block_slot, segments.block_first, segments.block_rows,
        r, split_k,
        y.stride(0), y.stride(1), b.stride(0), b.stride(1), out.stride(0), scales.stride(0),
        NUM_SLOTS=s, DOT_PRECISION=dot_precision(b.dtype),
        BLOCK_M=segments.block_m, BLOCK_N=block_n, BLOCK_R=block_r, N_TILES=n_tiles,
        ONE_R_BLOCK=r <= block_r, RANK_ALIGN=align, COL_ALIGN=col_align, num_warps=num_warps,
        **launch, **launch_options(out),
    )  # fmt: skip
    return out


def lora_expand_reference(
    y: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor,
    part_sizes: Sequence[int],
    ranks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference, out of place: out + the delta, computed in float32 from y [T, P x
    R] (the summed shrink). With `ranks`, B's columns past a slot's rank count as zeros."""
    r = b.shape[2]
    delta = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for s in range(b.shape[0]):
        rows = slots == s
        b_s = b[s].float()
        if ranks is not None:
            b_s = b_s * (torch.arange(r, device=b.device) < ranks[s])
        start = 0
        for p, size in enumerate(part_sizes):
            y_p = y[rows, p * r : (p + 1) * r].float()
            delta[rows, start : start + size] = scales[s, p] * (y_p @ b_s[start : start + size].T)
            start += size
    return (out.float() + delta).to(out.dtype)
