"""y = x @ W^T (+ bias) for a few rows of x: the projections of a small decode batch.

With one to a few tokens a linear layer only streams its weight, so its time is the weight's
bytes over the memory bandwidth reached. A library GEMM picks tiles made for many rows: for
Qwen2.5-7B's q/k/v (3584 -> 4608) and o (3584 -> 3584) projections at batch 1 it starts fewer
programs than the GPU has SMs. Here each program owns BLOCK_N output features over the whole K
and every program streams its rows of W once; the rows of x (at most BLOCK_M) ride along.

With `lora` (a LoraEpilogue) the launch also adds each row's LoRA delta, scale x y @ B^T of the
row's adapter, to the accumulator before the one store: lora_expand's work without its launch
and without a second pass over the output, for a layer whose shrink (lora_shrink) already ran.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout_kernels.precision import dot_precision

MAX_ROWS = 16  # x rows one launch takes; more rows are a job for a real GEMM


@dataclass(frozen=True)
class LoraEpilogue:
    """What the skinny GEMM needs to add the LoRA deltas of its rows (lora_expand's inputs):
    lora_y [split_k, M, P x R] float32 from lora_shrink; b [S, N, R]; row_slots [M], each row's
    slot (outside [0, S): no adapter); ranks [S] int32; scales [S, P] float32; offsets [P + 1]
    int32 on the device with `sizes`, the P projections' output columns. Each part's size must
    be a multiple of the launch's block_n (`fits` says whether it is)."""

    lora_y: torch.Tensor
    b: torch.Tensor
    row_slots: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    sizes: tuple[int, ...]

    def fits(self, block_n: int) -> bool:
        return lora_epilogue_fits(self.b.shape[2], self.sizes, block_n)


LORA_MAX_RANK = 128  # one tile of B's columns


def lora_epilogue_fits(max_rank: int, sizes: tuple[int, ...], block_n: int) -> bool:
    """Whether a layer of parts `sizes` with B's rank dim `max_rank` takes the LoRA epilogue
    at column tiles of block_n (shapes only: a layer asks once)."""
    return max_rank <= LORA_MAX_RANK and all(size % block_n == 0 for size in sizes)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    ly_ptr, lb_ptr, lslot_ptr, lrank_ptr, lscale_ptr, loff_ptr,
    R, SPLIT_K, stride_lys, stride_lym, stride_lbs, stride_lbn, stride_lss,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_LORA: tl.constexpr, NUM_SLOTS: tl.constexpr, NUM_PARTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < M
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
    if HAS_LORA:
        # This program's columns lie in one projection (the wrapper checked the parts' sizes).
        part = 0
        for q in range(1, NUM_PARTS):
            part += (pid * BLOCK_N >= tl.load(loff_ptr + q)).to(tl.int32)
        row_slot = tl.load(lslot_ptr + rows, mask=rmask, other=-1)
        rs = tl.arange(0, BLOCK_R)
        for s in range(NUM_SLOTS):
            sel = rmask & (row_slot == s)
            if tl.max(sel.to(tl.int32), axis=0) > 0:  # only the adapters this batch uses
                in_rank = rs < tl.load(lrank_ptr + s)
                ly = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
                for split in range(SPLIT_K):
                    ly += tl.load(
                        ly_ptr + split * stride_lys + rows[:, None] * stride_lym + part * R
                        + rs[None, :],
                        mask=sel[:, None] & in_rank[None, :], other=0.0,
                    )  # fmt: skip
                lb_t = tl.load(
                    lb_ptr + s * stride_lbs + cols[None, :].to(tl.int64) * stride_lbn + rs[:, None],
                    mask=in_rank[:, None] & cmask[None, :], other=0.0,
                )  # [BLOCK_R, BLOCK_N]: B's rows as columns
                scale = tl.load(lscale_ptr + s * stride_lss + part)
                acc += tl.dot(ly.to(lb_t.dtype), lb_t, input_precision=DOT_PRECISION) * scale
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
    lora: LoraEpilogue | None = None,
) -> torch.Tensor:
    """x: [M, K] with M <= MAX_ROWS, weight: [N, K], bias: [N] or None, all one dtype;
    the last dim of x and weight contiguous. Returns [M, N] = x @ weight.T + bias in x's dtype,
    accumulated in float32, plus each row's LoRA delta with `lora` (see LoraEpilogue).

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
    if lora is not None:
        _check_lora(lora, m, n, block_n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if x.element_size() > 2:
        block_k //= 2
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    if lora is None:
        # Unread without HAS_LORA: any tensor for its six pointers, zeros for its seven ints.
        lora_args, r = (weight,) * 6 + (0,) * 7, 16
        slots = parts = 1
    else:
        ly, lb = lora.lora_y, lora.b
        r = lb.shape[2]
        lora_args = (
            ly, lb, lora.row_slots, lora.ranks, lora.scales, lora.offsets, r, ly.shape[0],
            ly.stride(0), ly.stride(1), lb.stride(0), lb.stride(1), lora.scales.stride(0),
        )  # fmt: skip
        slots, parts = lb.shape[0], len(lora.sizes)
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y,
        m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        *lora_args,
        HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(x.dtype), BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_LORA=lora is not None, NUM_SLOTS=slots, NUM_PARTS=parts,
        BLOCK_R=max(16, triton.next_power_of_2(r)),
        num_warps=num_warps, num_stages=num_stages,
    )
    return y


def _check_lora(lora: LoraEpilogue, m: int, n: int, block_n: int) -> None:
    ly, lb = lora.lora_y, lora.b
    s, p = lb.shape[0], len(lora.sizes)
    if (
        ly.dim() != 3
        or ly.shape[1:] != (m, p * lb.shape[2])
        or lb.shape[1] != n
        or sum(lora.sizes) != n
        or lora.row_slots.shape != (m,)
        or lora.ranks.shape != (s,)
        or lora.scales.shape != (s, p)
        or lora.offsets.shape != (p + 1,)
    ):
        raise ValueError(
            f"skinny_gemm's LoRA epilogue needs lora_y [split, M, P x R], b [S, N, R], row_slots "
            f"[M], ranks [S], scales [S, P] and offsets [P + 1] with parts summing to N; got "
            f"lora_y {tuple(ly.shape)}, b {tuple(lb.shape)}, row_slots "
            f"{tuple(lora.row_slots.shape)}, ranks {tuple(lora.ranks.shape)}, scales "
            f"{tuple(lora.scales.shape)}, offsets {tuple(lora.offsets.shape)}, parts {lora.sizes}"
            f" for M={m}, N={n}"
        )
    if ly.dtype != torch.float32 or ly.stride(-1) != 1 or lb.stride(-1) != 1:
        raise ValueError("skinny_gemm's LoRA epilogue needs lora_y float32 and B's last dim contiguous")
    if not lora.fits(block_n):
        raise ValueError(
            f"skinny_gemm's LoRA epilogue needs ranks of at most {LORA_MAX_RANK} and "
            f"parts that are multiples of block_n {block_n}; got rank {lb.shape[2]}, parts {lora.sizes}"
        )
