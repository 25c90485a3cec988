"""Fused RMSNorm, rotary embedding and SiLU-and-mul against the model layers they stand for.

Float32 must agree to rounding; bfloat16 to one bf16 step (Triton's interpreter rounds
float32 -> bf16 by truncation, the GPU to nearest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.models.layers import RMSNorm, apply_rotary  # noqa: E402
from rollout_kernels.rmsnorm import rms_norm  # noqa: E402
from rollout_kernels.rotary import apply_rotary_inplace  # noqa: E402
from rollout_kernels.silu_and_mul import silu_and_mul  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 48])
def test_rms_norm_matches_layer(device, dtype, dim):
    gen = torch.Generator().manual_seed(0)
    layer = RMSNorm(dim, eps=1e-6)
    layer.weight.data = torch.randn(dim, generator=gen) * 0.5 + 1
    layer = layer.to(device, dtype)
    x = (torch.randn(2, 5, dim, generator=gen) * 3).to(device, dtype)
    residual = torch.randn(2, 5, dim, generator=gen).to(device, dtype)
    with torch.no_grad():
        want = layer(x)
        want_out, want_res = layer(x, residual)
    torch.testing.assert_close(rms_norm(x, layer.weight, 1e-6), want, **_tol(dtype))
    out, new_res = rms_norm(x, layer.weight, 1e-6, residual=residual)
    torch.testing.assert_close(out, want_out, **_tol(dtype))
    torch.testing.assert_close(new_res, want_res, **_tol(dtype))
    assert out.dtype == dtype and out.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_heads_of_a_qkv_view(device, dtype):
    """Qwen3's q/k norm: each head of a strided [T, H, D] view of the fused qkv output."""
    gen = torch.Generator().manual_seed(3)
    t, heads, dim = 5, 3, 16
    layer = RMSNorm(dim, eps=1e-6)
    layer.weight.data = torch.randn(dim, generator=gen) * 0.5 + 1
    layer = layer.to(device, dtype)
    qkv = (torch.randn(t, (heads + 2) * dim, generator=gen) * 2).to(device, dtype)
    q = qkv[:, dim : (heads + 1) * dim].view(t, heads, dim)  # offset, row stride (H + 2) * D
    with torch.no_grad():
        want = layer(q)
    got = rms_norm(q, layer.weight, 1e-6)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert got.shape == (t, heads, dim) and got.is_contiguous()


def test_rms_norm_rejects_wrong_weight(device):
    with pytest.raises(ValueError, match=r"weight of shape \(8,\)"):
        rms_norm(torch.zeros(2, 8, device=device), torch.ones(4, device=device), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [32, 24])
def test_rotary_matches_layer_on_qkv_views(device, dtype, dim):
    gen = torch.Generator().manual_seed(1)
    t, heads, kv_heads = 7, 4, 2
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(dim // 2, generator=gen)
    cos, sin = freqs.cos()[:, None, :].to(device), freqs.sin()[:, None, :].to(device)
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    apply_rotary_inplace(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, **_tol(dtype))
    torch.testing.assert_close(k, want_k, **_tol(dtype))
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v is left alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 40])
def test_silu_and_mul_matches_mlp_activation(device, dtype, width):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 4, 2 * width, generator=gen) * 4).to(device, dtype)
    gate, up = x.split(width, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, **_tol(dtype))


def test_silu_and_mul_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.zeros(2, 5, device=device))
