"""KV-cache store: writes the new tokens' K and V into their slots of the paged pool, cast to
the pool's element type (an 8-bit float pool clamps to its range first)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.pdl import launch_options, pdl_start


@triton.jit
def to_cache_dtype(x, cache_ptr):
    """x cast for a store through cache_ptr; into an 8-bit float cache, clamped to the type's
    finite range first, as rollout.forward.kv_pool.to_kv_dtype does."""
    dtype = cache_ptr.dtype.element_ty
    if dtype.is_fp8e4nv():
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    elif dtype.is_fp8e5():
        x = tl.clamp(x.to(tl.float32), -57344.0, 57344.0)
    return x.to(dtype)


@triton.jit
def from_cache_dtype(x, dtype: tl.constexpr):
    """Cached keys or values x as `dtype` (the query's). An 8-bit float goes through float32,
    exactly: Triton's interpreter converts 8-bit floats to bfloat16 wrongly."""
    if x.dtype.is_fp8():
        x = x.to(tl.float32)
    return x.to(dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, loc_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_ch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    # One program per new token: all its heads, K and V.
    t = tl.program_id(0)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = slot * stride_ct + heads * stride_ch + dims
    tl.store(k_cache_ptr + dst, to_cache_dtype(k, k_cache_ptr), mask=mask)
    tl.store(v_cache_ptr + dst, to_cache_dtype(v, v_cache_ptr), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D], any token and head strides (the head dim must be contiguous);
    k_cache, v_cache: [slots, Hkv, D] contiguous, same layout; loc: [T] slot of each token.
    Writes k[t] to k_cache[loc[t]] (cast to the cache dtype), likewise v."""
    t, heads, dim = k.shape
    if v.shape != k.shape or k_cache.shape[1:] != (heads, dim) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"store_kv needs k, v of [T, Hkv, D] and caches of [slots, Hkv, D] with the same "
            f"Hkv, D; got k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}, "
            f"{tuple(v_cache.shape)}"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs a contiguous head dim in k, v and contiguous caches")
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1),
        NUM_HEADS=heads, HEAD_DIM=dim,
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim),
        **launch_options(k),
    )
