"""Paged extend (prefill) attention: the new tokens of each request attend over its cached
prefix and, causally, over each other.

The new tokens' K/V are stored in the pool before this runs, so every key is read through the
request's row of req_to_token; a query at absolute position p sees keys 0..p. One program
serves one block of a request's new tokens for one query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.kv_store import from_cache_dtype
from rollout_kernels.paged_inputs import check_paged_inputs
from rollout_kernels.precision import dot_precision


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    req_to_token_ptr, req_pool_ptr, seq_lens_ptr, extend_lens_ptr, extend_starts_ptr,
    sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ct, stride_ch, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    ext = tl.load(extend_lens_ptr + b).to(tl.int32)
    if block * BLOCK_M >= ext:  # the grid is sized for the longest extend of the batch
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = tl.load(extend_starts_ptr + b).to(tl.int64)
    row = tl.load(req_pool_ptr + b).to(tl.int64)
    prefix = seq_len - ext
    kv_head = head // GROUP

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this request's new tokens
    dims = tl.arange(0, BLOCK_D)
    mmask = rows < ext
    dmask = dims < HEAD_DIM
    q_offs = (start + rows[:, None]) * stride_qt + head * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=mmask[:, None] & dmask[None, :], other=0.0)  # [M, D]
    q_pos = prefix + rows  # absolute position of each query

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    # Keys past this block's last query are masked for every row of it: stop there.
    kv_end = tl.minimum(seq_len, prefix + (block + 1) * BLOCK_M)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < kv_end
        slots = tl.load(req_to_token_ptr + row * stride_rt + pos, mask=nmask, other=0).to(tl.int64)
        kv_offs = slots[:, None] * stride_ct + kv_head * stride_ch + dims[None, :]
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(from_cache_dtype(k, q.dtype)), input_precision=DOT_PRECISION) * sm_scale  # [M, N]
        visible = nmask[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # Every row sees key 0, so after the first block m is finite and no exp gives NaN.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), from_cache_dtype(v, q.dtype), input_precision=DOT_PRECISION)
        m = m_new

    out = acc / denom[:, None]
    out_offs = (start + rows[:, None]) * stride_ot + head * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D] (head dim contiguous), the new tokens of B requests back to back: request
    b owns rows extend_starts[b] : extend_starts[b] + extend_lens[b]. k_cache, v_cache:
    [slots, Hkv, D] contiguous, already holding every key of every request (prefix and new);
    req_to_token row req_pool_indices[b] lists them; seq_lens[b] = prefix + extend_lens[b].
    `max_extend_len` (a host int >= every extend_lens[b]) sizes the grid without a device sync.
    Returns out [T, H, D] in q's dtype."""
    t, heads, dim = q.shape
    check_paged_inputs("extend_attention", q, k_cache, v_cache, req_to_token, "T")
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0 or max_extend_len <= 0:
        return out
    # Float32 tiles take twice the shared memory of bf16 ones: halve them.
    block = 32 if q.dtype == torch.float32 else 64
    grid = (batch, heads, triton.cdiv(max_extend_len, block))
    _extend_kernel[grid](
        q, k_cache, v_cache, out,
        req_to_token, req_pool_indices, seq_lens, extend_lens, extend_starts,
        sm_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        GROUP=heads // kv_heads, HEAD_DIM=dim, DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_M=block, BLOCK_N=block, BLOCK_D=max(16, triton.next_power_of_2(dim)),
    )
    return out
