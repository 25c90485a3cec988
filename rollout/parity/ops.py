"""The trainer-side ops of the parity model: each runs forward on the engine's batch-invariant
kernels (bit for bit what deterministic inference computes) and backward through the plain
torch formula of the same op.

`kernel_op(kernel, reference, *inputs)` is the one autograd bridge: forward returns
kernel(*inputs); backward recomputes reference(*inputs) with autograd on and differentiates
it. The reference is the math the kernel implements, so the gradients are torch autograd's
at the kernel's inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from rollout.models.layers import apply_rotary
from rollout_kernels.batch_invariant_gemm import batch_invariant_linear
from rollout_kernels.deterministic_attention import deterministic_attention
from rollout_kernels.rmsnorm import rms_norm
from rollout_kernels.rotary import apply_rotary_inplace
from rollout_kernels.silu_and_mul import silu_and_mul

Tensors = tuple[torch.Tensor, ...]


class _KernelOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fns: tuple[Callable, Callable], *inputs: torch.Tensor | None):  # type: ignore[override]
        kernel, ctx.reference = fns
        ctx.save_for_backward(*inputs)
        return kernel(*inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):  # type: ignore[override]
        wants = ctx.needs_input_grad[1:]
        with torch.enable_grad():
            leaves = [
                None if x is None else x.detach().requires_grad_(want)
                for x, want in zip(ctx.saved_tensors, wants)
            ]
            outs = ctx.reference(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        targets = [leaf for leaf, want in zip(leaves, wants) if want]
        got = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
            )
            if pairs and targets
            else [None] * len(targets)
        )
        return (None, *[next(got) if want else None for want in wants])


def kernel_op(
    kernel: Callable[..., torch.Tensor | Tensors],
    reference: Callable[..., torch.Tensor | Tensors],
    *inputs: torch.Tensor | None,
) -> torch.Tensor | Tensors:
    """kernel(*inputs), differentiated as reference(*inputs) (the same math in torch ops)."""
    return _KernelOp.apply((kernel, reference), *inputs)


def fused_linear(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> torch.Tensor:
    """x: [T, K] through each weight [N_i, K] (+ bias), side by side in one [T, sum N_i] buffer:
    the layout of the engine's merged projections (qkv, gate_up), so the kernels after it read
    the same strides. The weights are used in place, never concatenated."""
    sizes = [w.shape[0] for w in weights]

    def kernel(x, *params):
        out = torch.empty((x.shape[0], sum(sizes)), dtype=x.dtype, device=x.device)
        for i, col in enumerate(out.split(sizes, dim=-1)):
            batch_invariant_linear(x, params[i], params[len(sizes) + i], out=col)
        return out

    def reference(x, *params):
        return torch.cat(
            [F.linear(x, params[i], params[len(sizes) + i]) for i in range(len(sizes))], dim=-1
        )

    return kernel_op(kernel, reference, x, *weights, *biases)


def linear(
    x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x: [T, K] -> [T, N] (in out_dtype: float32 for the LM head's logits)."""
    dtype = out_dtype or x.dtype
    return kernel_op(
        lambda x, w: batch_invariant_linear(x, w, out_dtype=dtype),
        lambda x, w: F.linear(x, w).to(dtype),
        x,
        weight,
    )


def _norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm's torch path (the rounding the kernel follows)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual), or (norm(x), x) before the first layer: the
    engine's deferred residual add."""
    if residual is None:
        return kernel_op(
            lambda x, w: rms_norm(x, w, eps), lambda x, w: _norm_reference(x, w, eps), x, weight
        ), x

    def reference(x, r, w):
        summed = x + r
        return _norm_reference(summed, w, eps), summed

    return kernel_op(lambda x, r, w: rms_norm(x, w, eps, r), reference, x, residual, weight)


def rotary_qkv(
    qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor, sin: torch.Tensor,
    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
) -> Tensors:  # fmt: skip
    """qkv: [T, (H + 2 Hkv) D], heads = (H, Hkv, D) -> (q [T, H, D] rotated, a view of a fresh
    buffer laid out as qkv, as the engine's is; k and v [T, Hkv, D] contiguous, k rotated): one
    launch of the engine's rotary kernel, norming q and k per head first when q_norm is given,
    storing k and v as it stores them into the KV cache."""
    h, hkv, d = heads
    t = qkv.shape[0]

    def split(buf):
        q, k, v = buf.split([h * d, hkv * d, hkv * d], dim=-1)
        return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)

    def kernel(qkv, cos, sin, qw, kw):
        q, k, v = split(qkv.clone())
        k_out, v_out = k.new_empty(k.shape), v.new_empty(v.shape)
        slots = torch.arange(t, device=qkv.device)
        norm = None if qw is None else (qw, kw, eps)
        apply_rotary_inplace(q, k, cos, sin, norm=norm, store=(v, k_out, v_out, slots))
        return q, k_out, v_out

    def reference(qkv, cos, sin, qw, kw):
        q, k, v = split(qkv)
        if qw is not None:
            q, k = _norm_reference(q, qw, eps), _norm_reference(k, kw, eps)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v.contiguous()

    return kernel_op(kernel, reference, qkv, cos, sin, q_norm, k_norm)


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scaling: float
) -> torch.Tensor:
    """q: [T, H, D], k, v: [T, Hkv, D]: B sequences of `lengths` back to back, each attending
    causally within itself -> [T, H, D]. The engine's attention kernel reads k and v as its KV
    cache through an identity table (sequence b's token i in slot start_b + i)."""
    dev = q.device
    lens = torch.tensor(lengths, dtype=torch.int64, device=dev)
    starts = torch.cumsum(lens, 0) - lens
    longest = max(lengths)
    table = (starts[:, None] + torch.arange(longest, device=dev)[None, :]).clamp_(
        max=q.shape[0] - 1
    )
    rows = torch.arange(len(lengths), device=dev)

    def kernel(q, k, v):
        return deterministic_attention(q, k, v, table, rows, lens, lens, starts, longest, scaling)

    def reference(q, k, v):
        group = q.shape[1] // k.shape[1]
        outs = []
        for s, n in zip(starts.tolist(), lengths):
            qs = q[s : s + n].transpose(0, 1)  # [H, n, D]
            ks = k[s : s + n].repeat_interleave(group, dim=1).transpose(0, 1)
            vs = v[s : s + n].repeat_interleave(group, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)

    return kernel_op(kernel, reference, q, k, v)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, up) -> silu(gate) * up [T, I], rounding as the engine's kernel."""

    def reference(x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    return kernel_op(silu_and_mul, reference, gate_up)
