"""Rotary position embedding in the GPT-NeoX / HF layout (each head rotated in halves), on q
and k in place in one launch, with the cos/sin that the model computes once per forward.

The same launch can also do the steps around it, so a layer spends one kernel where it spent
up to four: the per-head RMSNorm of q and k before rotating (Qwen3's q_norm/k_norm), and the
store of the rotated k and of v into their slots of the paged KV cache. It rounds where the
torch path rounds: the normalised value to the input dtype before the weight multiplies it,
the weighted value to the input dtype, the rotated value to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.kv_store import to_cache_dtype
from rollout_kernels.pdl import launch_options, pdl_start
from rollout_kernels.rmsnorm import weighted_norm


@triton.jit
def _rotate_heads(x_ptr, stride_t, stride_h, t, cos, sin, w_ptr, eps,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotates (after norming, with NORM) the heads of token t in place; returns both halves."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    ptr = x_ptr + t * stride_t + heads * stride_h + cols
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        inv_rms = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
        a = weighted_norm(a, inv_rms, w1, dtype).to(dtype).to(tl.float32)
        b = weighted_norm(b, inv_rms, w2, dtype).to(dtype).to(tl.float32)
    new1 = (a * cos - b * sin).to(dtype)
    new2 = (b * cos + a * sin).to(dtype)
    tl.store(ptr, new1, mask=mask)
    tl.store(ptr + HALF, new2, mask=mask)
    return new1, new2


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr,
    eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st, stride_vt, stride_vh,
    stride_cache_t, stride_cache_h,
    Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr,
    NORM: tl.constexpr, STORE: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program per token: cos/sin are loaded once and shared by all its q and k heads.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + t * stride_ct + cols, mask=cols < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_st + cols, mask=cols < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, cos, sin, q_w_ptr, eps,
                  Q_HEADS, HALF, NORM, BLOCK_QH, BLOCK_HALF)
    k1, k2 = _rotate_heads(k_ptr, stride_kt, stride_kh, t, cos, sin, k_w_ptr, eps,
                           K_HEADS, HALF, NORM, BLOCK_KH, BLOCK_HALF)
    if STORE:
        slot = tl.load(loc_ptr + t).to(tl.int64)
        heads = tl.arange(0, BLOCK_KH)[:, None]
        halves = cols[None, :]
        mask = (heads < K_HEADS) & (halves < HALF)
        dst = slot * stride_cache_t + heads * stride_cache_h + halves
        tl.store(k_cache_ptr + dst, to_cache_dtype(k1, k_cache_ptr), mask=mask)
        tl.store(k_cache_ptr + dst + HALF, to_cache_dtype(k2, k_cache_ptr), mask=mask)
        src = v_ptr + t * stride_vt + heads * stride_vh + halves
        tl.store(v_cache_ptr + dst, to_cache_dtype(tl.load(src, mask=mask), v_cache_ptr), mask=mask)
        tl.store(v_cache_ptr + dst + HALF, to_cache_dtype(tl.load(src + HALF, mask=mask), v_cache_ptr), mask=mask)


def apply_rotary_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """q: [T, H, D], k: [T, Hkv, D], any token/head strides with the head dim contiguous
    (views into the fused qkv output are fine); cos, sin: [T, D/2] or [T, 1, D/2] float32, as
    RotaryEmbedding returns them. Rotates both in place, computing in float32 like
    layers.apply_rotary.

    norm = (q_weight [D], k_weight [D], eps): first RMSNorm each head as layers.RMSNorm does.
    store = (v [T, Hkv, D], k_cache, v_cache [slots, Hkv, D] contiguous, loc [T]): then also
    write the rotated k[t] to k_cache[loc[t]] and v[t] to v_cache[loc[t]], as kv_store.store_kv."""
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
    q_w, k_w, eps = norm if norm is not None else (cos, cos, 0.0)  # unused without norm
    if norm is not None and (q_w.shape != (dim,) or k_w.shape != (dim,)):
        raise ValueError(
            f"apply_rotary_inplace needs norm weights of shape ({dim},), got {tuple(q_w.shape)}, "
            f"{tuple(k_w.shape)}"
        )
    v, k_cache, v_cache, loc = store if store is not None else (k, k, k, cos)  # unused without store
    if store is not None:
        if v.shape != k.shape or v.stride(-1) != 1:
            raise ValueError(f"apply_rotary_inplace needs v shaped like k {tuple(k.shape)}, got {tuple(v.shape)}")
        if k_cache.shape[1:] != k.shape[1:] or v_cache.shape != k_cache.shape or loc.shape != (t,):
            raise ValueError(
                f"apply_rotary_inplace needs caches of [slots, {k.shape[1]}, {dim}] and loc of [{t}]; "
                f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}, {tuple(loc.shape)}"
            )
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("apply_rotary_inplace needs contiguous KV caches")
    if t == 0:
        return
    _rotary_kernel[(t,)](
        q, k, cos, sin, q_w, k_w, v, k_cache, v_cache, loc,
        eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1),
        Q_HEADS=q.shape[1], K_HEADS=k.shape[1], HALF=dim // 2,
        NORM=norm is not None, STORE=store is not None,
        BLOCK_QH=triton.next_power_of_2(q.shape[1]), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(dim // 2), **launch_options(q),
    )
