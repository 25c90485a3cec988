"""Merging partial attention results: each part attended over a disjoint piece of the keys
and kept its log-sum-exp, so the exact softmax over all keys is a weighted sum of the parts."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(
    part_ptr, lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    NUM_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    parts = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    smask = parts < NUM_PARTS
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + parts, mask=smask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top > float("-inf"), top, 0.0)  # no -inf - -inf when every part is empty
    # An empty part has lse = -inf and weight 0.
    weight = tl.where(smask & (lse > float("-inf")), tl.exp(lse - top), 0.0)  # [S]
    offs = b * stride_pb + h * stride_ph + parts[:, None] * stride_ps + dims[None, :]
    # An empty part need not have been written: it is not read.
    mask = (smask & (lse > float("-inf")))[:, None] & (dims[None, :] < HEAD_DIM)
    part = tl.load(part_ptr + offs, mask=mask, other=0.0)  # [S, D]
    total = tl.sum(weight, axis=0)
    # A row with no keys at all (CUDA-graph padding) has total 0: it gets zeros, not NaN.
    out = tl.sum(part * weight[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


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
        BLOCK_S=triton.next_power_of_2(s), BLOCK_D=triton.next_power_of_2(d),
    )
