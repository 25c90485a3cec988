"""SiLU-and-mul: the gated MLP's silu(gate) * up in one pass over the fused gate_up output.

With `delta` (float32, shaped like the gate_up output: its LoRA delta, computed beside the
projection: rollout/models/lora_layer.py) gate and up are first gate + delta and up + delta,
rounded to their dtype: what the projection's output would have been had the delta been added
to it in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.pdl import launch_options, pdl_start


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, delta_ptr, stride_x, stride_o, stride_d,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d_gate = tl.load(delta_ptr + row * stride_d + cols, mask=mask, other=0.0)
        d_up = tl.load(delta_ptr + row * stride_d + WIDTH + cols, mask=mask, other=0.0)
        gate = (gate.to(tl.float32) + d_gate).to(x_ptr.dtype.element_ty)
        up = (up.to(tl.float32) + d_up).to(x_ptr.dtype.element_ty)
    g = gate.to(tl.float32)
    # F.silu rounds to the input dtype before the multiply; so does this.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2I], gate in the first half of the last dim and up in the second (the
    layout of SiluAndMulMLP.gate_up_proj). Returns silu(gate) * up, [..., I] in x's dtype.
    `delta` (float32, x's shape, last dim contiguous) is added to x first, rounded to its dtype."""
    width2 = x.shape[-1]
    if width2 % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate and up halves), got {width2}")
    if delta is not None and (
        delta.shape != x.shape or delta.dtype != torch.float32 or delta.stride(-1) != 1
    ):
        raise ValueError(
            f"silu_and_mul needs delta float32, shaped like x {tuple(x.shape)} with its last dim "
            f"contiguous, got {delta.dtype} {tuple(delta.shape)}"
        )
    width = width2 // 2
    x2 = x.reshape(-1, width2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
    delta2 = out if delta is None else delta.reshape(-1, width2)
    block = min(1024, triton.next_power_of_2(width))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
            x2, out, delta2, x2.stride(0), out.stride(0), delta2.stride(0),
            WIDTH=width, BLOCK=block, HAS_DELTA=delta is not None, **launch_options(x2),
        )  # fmt: skip
    return out.view(*x.shape[:-1], width)
