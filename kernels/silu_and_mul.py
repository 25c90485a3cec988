"""SiLU-and-mul: the gated MLP's silu(gate) * up in one pass over the fused gate_up output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.pdl import launch_options, pdl_start


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o,
    WIDTH: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + WIDTH + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # F.silu rounds to the input dtype before the multiply; so does this.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I], gate in the first half of the last dim and up in the second (the
    layout of SiluAndMulMLP.gate_up_proj). Returns silu(gate) * up, [..., I] in x's dtype."""
    width2 = x.shape[-1]
    if width2 % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate and up halves), got {width2}")
    width = width2 // 2
    x2 = x.reshape(-1, width2)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], width), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(width, block))](
            x2, out, x2.stride(0), out.stride(0), WIDTH=width, BLOCK=block, **launch_options(x2)
        )
    return out.view(*x.shape[:-1], width)
