"""Fused RMSNorm, rotary embedding (with the q/k norm and KV store it can fold in) and
SiLU-and-mul against the model layers and kernels they stand for.

Float32 must agree to rounding; bfloat16 to one bf16 step (Triton's interpreter rounds
float32 -> bf16 by truncation, the GPU to nearest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from rollout.models.layers import RMSNorm, apply_rotary  # noqa: E402
from rollout_kernels.kv_store import store_kv  # noqa: E402
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_a_float32_delta_to_x_first(device, dtype):
    """The norm after a projection whose LoRA delta ran beside it: x + delta, rounded to x's
    dtype, is what the norm reads (and what the new residual sums)."""
    gen = torch.Generator().manual_seed(4)
    dim = 48
    layer = RMSNorm(dim, eps=1e-6)
    layer.weight.data = torch.randn(dim, generator=gen) * 0.5 + 1
    layer = layer.to(device, dtype)
    x = (torch.randn(6, dim, generator=gen) * 3).to(device, dtype)
    residual = torch.randn(6, dim, generator=gen).to(device, dtype)
    delta = (torch.randn(6, dim, generator=gen) * 2).to(device)
    summed = (x.float() + delta).to(dtype)
    with torch.no_grad():
        want_out, want_res = layer(summed, residual)
        # the torch path with a delta is the same
        torch.testing.assert_close(layer.add_norm(x, residual, delta)[1], want_res)
    out, new_res = rms_norm(x, layer.weight, 1e-6, residual=residual, delta=delta)
    torch.testing.assert_close(out, want_out, **_tol(dtype))
    torch.testing.assert_close(new_res, want_res, **_tol(dtype))
    torch.testing.assert_close(rms_norm(x, layer.weight, 1e-6, delta=delta), layer(summed), **_tol(dtype))
    without = rms_norm(x, layer.weight, 1e-6, residual=residual)[1]
    assert (new_res - without).abs().max() > 0.5  # the delta was added
    with pytest.raises(ValueError, match="rms_norm needs delta float32"):
        rms_norm(x, layer.weight, 1e-6, residual=residual, delta=delta.to(dtype=torch.float16))
    with pytest.raises(ValueError, match="rms_norm needs delta float32"):
        rms_norm(x, layer.weight, 1e-6, residual=residual, delta=delta[:5])


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
@pytest.mark.parametrize("dim", [32, 24])
def test_rotary_with_qk_norm_and_kv_store_matches_the_separate_steps(device, dtype, dim):
    """One launch for Qwen3's q_norm/k_norm, the rotation and the KV store: as the layers and
    store_kv do it one after another."""
    gen = torch.Generator().manual_seed(4)
    t, heads, kv_heads, slots = 6, 4, 2, 20
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen) * 2).to(device, dtype)
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    norms = [RMSNorm(dim, eps=1e-6) for _ in range(2)]
    for layer in norms:
        layer.weight.data = torch.randn(dim, generator=gen) * 0.5 + 1
    q_norm, k_norm = (layer.to(device, dtype) for layer in norms)
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(dim // 2, generator=gen)
    cos, sin = freqs.cos()[:, None, :].to(device), freqs.sin()[:, None, :].to(device)
    loc = torch.randperm(slots - 1, generator=gen)[:t].add(1).to(device)
    with torch.no_grad():
        want_q, want_k = apply_rotary(q_norm(q), cos, sin), apply_rotary(k_norm(k), cos, sin)
    want_k_cache = torch.zeros(slots, kv_heads, dim, dtype=dtype, device=device)
    want_v_cache = torch.zeros_like(want_k_cache)
    store_kv(want_k, v, want_k_cache, want_v_cache, loc)
    k_cache, v_cache = torch.zeros_like(want_k_cache), torch.zeros_like(want_v_cache)
    apply_rotary_inplace(
        q, k, cos, sin, norm=(q_norm.weight, k_norm.weight, 1e-6), store=(v, k_cache, v_cache, loc)
    )
    # bf16 rounds three times on the way (norm, weight, rotation): up to three bf16 steps.
    tol = _tol(dtype) if dtype == torch.float32 else {"rtol": 2.4e-2, "atol": 2e-2}
    torch.testing.assert_close(q, want_q, **tol)
    torch.testing.assert_close(k, want_k, **tol)
    torch.testing.assert_close(k_cache, want_k_cache, **tol)
    assert torch.equal(v_cache, want_v_cache)  # v is copied, not changed
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert not k_cache[untouched.to(device)].any()  # nothing written outside loc


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rotary_stores_into_an_fp8_cache_as_store_kv_does(device, cache_dtype):
    # The rotated k and v go into an 8-bit cache with store_kv's cast (clamped to the range).
    gen = torch.Generator().manual_seed(6)
    t, heads, kv_heads, dim, slots = 5, 4, 2, 16, 12
    qkv = (torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(device)
    qkv[0, heads * dim] = 1e6  # a key past either 8-bit range
    q = qkv[:, : heads * dim].view(t, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * torch.rand(dim // 2, generator=gen)
    cos, sin = freqs.cos()[:, None, :].to(device), freqs.sin()[:, None, :].to(device)
    loc = torch.tensor([3, 7, 1, 10, 5], device=device)
    want_q, want_k = q.clone(), k.clone()
    apply_rotary_inplace(want_q, want_k, cos, sin)
    want_k_cache = torch.zeros(slots, kv_heads, dim, dtype=cache_dtype, device=device)
    want_v_cache = torch.zeros_like(want_k_cache)
    store_kv(want_k, v, want_k_cache, want_v_cache, loc)
    k_cache, v_cache = torch.zeros_like(want_k_cache), torch.zeros_like(want_v_cache)
    apply_rotary_inplace(q, k, cos, sin, store=(v, k_cache, v_cache, loc))
    assert torch.equal(k_cache.float(), want_k_cache.float())
    assert torch.equal(v_cache.float(), want_v_cache.float())
    assert k_cache.float().abs().max() == torch.finfo(cache_dtype).max  # clamped, finite


def test_rotary_rejects_a_cache_of_other_heads(device):
    q, k = torch.zeros(2, 4, 8, device=device), torch.zeros(2, 2, 8, device=device)
    cos = torch.zeros(2, 4, device=device)
    cache = torch.zeros(5, 3, 8, device=device)
    with pytest.raises(ValueError, match=r"caches of \[slots, 2, 8\]"):
        apply_rotary_inplace(q, k, cos, cos, store=(k, cache, cache, torch.zeros(2, dtype=torch.int64, device=device)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [128, 40])
def test_silu_and_mul_matches_mlp_activation(device, dtype, width):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 4, 2 * width, generator=gen) * 4).to(device, dtype)
    gate, up = x.split(width, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), F.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_adds_a_float32_delta_to_gate_and_up_first(device, dtype):
    gen = torch.Generator().manual_seed(5)
    width = 40
    x = (torch.randn(3, 2 * width, generator=gen) * 4).to(device, dtype)
    delta = (torch.randn(3, 2 * width, generator=gen) * 2).to(device)
    gate, up = (x.float() + delta).to(dtype).split(width, dim=-1)
    got = silu_and_mul(x, delta)
    # bf16: two steps, the sums and the product each rounded (by truncation on the interpreter)
    tol = _tol(dtype) if dtype == torch.float32 else {"rtol": 3.2e-2, "atol": 1e-2}
    torch.testing.assert_close(got, F.silu(gate) * up, **tol)
    assert (got.float() - silu_and_mul(x).float()).abs().max() > 0.5  # the delta was added
    with pytest.raises(ValueError, match="silu_and_mul needs delta float32"):
        silu_and_mul(x, delta[:, :-2])
    with pytest.raises(ValueError, match="silu_and_mul needs delta float32"):
        silu_and_mul(x, delta.to(torch.float16))


def test_silu_and_mul_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even last dim"):
        silu_and_mul(torch.zeros(2, 5, device=device))
