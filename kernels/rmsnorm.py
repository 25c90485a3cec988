"""Fused RMSNorm, optionally with the residual add before it: one read of x (and residual),
one write of the output (and of the new residual), instead of a kernel per elementwise op.
With `delta` (float32, shaped like x: the LoRA delta of the projection that wrote x, computed
beside it: rollout/models/lora_layer.py) x is first x + delta, rounded to x's dtype: what the
projection's output would have been had the delta been added to it in place.

Rounds where `rollout.models.layers.RMSNorm` rounds: the sum x + residual in the input dtype,
the normalised value to the input dtype before the weight multiplies it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.pdl import launch_options, pdl_start


@triton.jit
def weighted_norm(x, inv_rms, w, dtype):
    """x * inv_rms rounded to `dtype`, then times the weight w, in float32: where
    layers.RMSNorm rounds (the rotary kernel's q/k norm rounds the same way)."""
    return (x * inv_rms).to(dtype).to(tl.float32) * w


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, delta_ptr,
    stride_x, stride_xh, stride_r, stride_o, stride_ro, stride_d,
    eps,
    DIM: tl.constexpr, HEADS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_DELTA: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # Row r of the output is x[r // HEADS, r % HEADS]: a [T, H, D] input (q or k heads inside
    # the fused qkv output) is read in place, without first copying it to contiguous rows.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < DIM
    x_row = x_ptr + (row // HEADS) * stride_x + (row % HEADS) * stride_xh
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        x = (x + d).to(dtype).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = weighted_norm(x, inv_rms, w, dtype)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] (last dim contiguous); weight: [D]. Without a residual returns
    norm(x) * weight; with one (same shape as x) returns (norm(x + residual) * weight,
    x + residual), the layers.RMSNorm contract. Outputs are new contiguous tensors in x's
    dtype. A 3-d x without a residual is read through its strides (heads of a qkv view).
    `delta` (float32, x's shape, last dim contiguous) is added to x first, rounded to x's dtype."""
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm needs weight of shape ({dim},) for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm needs residual shaped like x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if delta is not None and (
        delta.shape != x.shape or delta.dtype != torch.float32 or delta.stride(-1) != 1
    ):
        raise ValueError(
            f"rms_norm needs delta float32, shaped like x {tuple(x.shape)} with its last dim "
            f"contiguous, got {delta.dtype} {tuple(delta.shape)}"
        )
    heads, stride_xh = 1, 0
    if x.dim() == 3 and residual is None and delta is None and x.stride(-1) == 1:
        x2, heads, stride_xh = x, x.shape[1], x.stride(1)
        rows = x.shape[0] * heads
    else:
        # reshape copies only where the leading dims cannot be flattened as a view.
        x2 = x.reshape(-1, dim)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    res2 = res_out = out  # unused placeholders when there is no residual
    if residual is not None:
        res2 = residual.reshape(-1, dim)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty_like(out)
    delta2 = out if delta is None else delta.reshape(-1, dim)
    if rows:
        _rmsnorm_kernel[(rows,)](
            x2, res2, weight, out, res_out, delta2,
            x2.stride(0), stride_xh, res2.stride(0), out.stride(0), res_out.stride(0),
            delta2.stride(0),
            eps,
            DIM=dim, HEADS=heads, HAS_RESIDUAL=residual is not None, HAS_DELTA=delta is not None,
            BLOCK_D=triton.next_power_of_2(dim), **launch_options(x2),
        )
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)
