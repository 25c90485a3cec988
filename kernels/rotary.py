"""Rotary position embedding in the GPT-NeoX / HF layout (each head rotated in halves), on q
and k in place in one launch, with the cos/sin that the model computes once per forward."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, t, cos, sin,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    ptr = x_ptr + t * stride_t + heads * stride_h + cols
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(ptr + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One program per token: cos/sin are loaded once and shared by all its q and k heads.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + t * stride_ct + cols, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_st + cols, mask=cols < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, cos, sin, Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, cos, sin, K_HEADS, HALF, BLOCK_KH, BLOCK_HALF)


def apply_rotary_inplace(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """q: [T, H, D], k: [T, Hkv, D], any token/head strides with the head dim contiguous
    (views into the fused qkv output are fine); cos, sin: [T, D/2] or [T, 1, D/2] float32, as
    RotaryEmbedding returns them. Rotates both in place, computing in float32 like
    layers.apply_rotary."""
    t, _, dim = q.shape
    if k.shape[0] != t or k.shape[2] != dim or dim % 2:
        raise ValueError(
            f"apply_rotary_inplace needs q [T, H, D] and k [T, Hkv, D] with the same T and an "
            f"even D; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    cos, sin = cos.reshape(t, -1), sin.reshape(t, -1)
    if cos.shape[1] != dim // 2 or sin.shape != cos.shape:
        raise ValueError(
            f"apply_rotary_inplace needs cos and sin of [T, {dim // 2}], got {tuple(cos.shape)}, "
            f"{tuple(sin.shape)}"
        )
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("apply_rotary_inplace needs the last dim of q, k, cos, sin contiguous")
    if t == 0:
        return
    _rotary_kernel[(t,)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        Q_HEADS=q.shape[1], K_HEADS=k.shape[1], HALF=dim // 2,
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(dim // 2),
    )
