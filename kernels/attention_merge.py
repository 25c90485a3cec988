"""Merging partial attention results: each part attended over a disjoint piece of the keys
and kept its log-sum-exp, so the exact softmax over all keys is a weighted sum of the parts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.pdl import launch_options, pdl_start


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    parts = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    lse_row = lse_ptr + b * stride_lb + h * stride_lh
    top = tl.max(tl.load(lse_row + parts, mask=parts < NUM_PARTS, other=float("-inf")), axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no -inf - -inf when every part is empty
    # Part by part, in order: trailing empty parts add exact zeros, so a larger NUM_PARTS with
    # the same non-empty parts gives the same bits (a CUDA graph's fixed count vs an eager one).
    acc = tl.zeros((BLOCK_D,), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    for s in tl.static_range(NUM_PARTS):
        lse = tl.load(lse_row + s)
        nonempty = lse > float("-inf")
        # An empty part has weight 0 and need not have been written: whatever it holds (NaN
        # included) is replaced by zeros.
        weight = tl.where(nonempty, tl.exp(lse - top), 0.0)
        part = tl.load(part_ptr + b * stride_pb + h * stride_ph + s * stride_ps + dims, mask=dmask, other=0.0)
        part = tl.where(nonempty, part, 0.0)
        acc += part * weight
        total += weight
    # A row with no keys at all (CUDA-graph padding) has total 0: it gets zeros, not NaN.
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dmask)


def merge_attention_parts(parts: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """parts: [B, H, S, D] float32, each part's softmax-normalised output (anything where
    empty: not read); lse: [B, H, S] float32, natural-log sum of exp(scores) of each part
    (-inf where empty);
    out: [B, H, D] (head dim contiguous), written with the merged result in its own dtype;
    zeros where every part is empty."""
    b, h, s, d = parts.shape
    if lse.shape != (b, h, s) or out.shape != (b, h, d):
        raise ValueError(
            f"merge_attention_parts needs parts [B, H, S, D], lse [B, H, S], out [B, H, D]; got "
            f"{tuple(parts.shape)}, {tuple(lse.shape)}, {tuple(out.shape)}"
        )
    if parts.stride(-1) != 1 or lse.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("merge_attention_parts needs the last dim of every tensor contiguous")
    if b == 0:
        return
    _merge_kernel[(b, h)](
        parts, lse, out,
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_PARTS=s, HEAD_DIM=d,
        BLOCK_S=triton.next_power_of_2(s), BLOCK_D=triton.next_power_of_2(d), **launch_options(out),
    )
