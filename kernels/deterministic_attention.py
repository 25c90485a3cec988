"""Batch-invariant paged attention: one kernel for prefill, chunked prefill, cache-hit extend
and decode, so a token's output is the same bits however it reached the model.

A program serves one KV head of one request: its tile's rows are (new token, query head of
that KV head's group) pairs, so a decode fills a tile with the group's heads rather than with
one row. Every query row walks its request's keys from position 0 upwards in BLOCK_N-key
blocks, with the same online-softmax update, the same compiled block shape and nothing split
across programs. A query at absolute position p sees keys 0..p whatever the step: its scores,
its running max and sums, and the order it adds them in are those of the same query in any
other batch. A decode step is an extend of one token per request. Blocks past a row's last
visible key (other rows of its tile may need them) change nothing: every one of their scores
is -inf, so the rescale factor is exactly 1 and the added terms exactly 0. Each row's result
is also independent of its place in the tile: tensor-core products treat every element
alike, and under the interpreter the products are written as sums over D in order (see
batch_invariant_gemm).

Keys are read through req_to_token as the other paged kernels read them; a trainer runs the
same kernel over its own contiguous K/V with an identity table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.paged_inputs import check_paged_inputs
from rollout_kernels.precision import dot_precision


@triton.jit
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    req_to_token_ptr, req_pool_ptr, seq_lens_ptr, extend_lens_ptr, extend_starts_ptr,
    sm_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_ct, stride_ch, stride_rt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    block = tl.program_id(2)
    ext = tl.load(extend_lens_ptr + b).to(tl.int32)
    if block * BLOCK_M >= ext * GROUP:  # the grid is sized for the longest extend of the batch
        return
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start = tl.load(extend_starts_ptr + b).to(tl.int64)
    row = tl.load(req_pool_ptr + b).to(tl.int64)
    prefix = seq_len - ext

    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // GROUP  # index among this request's new tokens
    head = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    mmask = tok < ext
    dmask = dims < HEAD_DIM
    q_offs = (start + tok[:, None]) * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=mmask[:, None] & dmask[None, :], other=0.0)  # [M, D]
    q_pos = prefix + tok  # absolute position of each query

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    kv_end = tl.minimum(seq_len, prefix + ((block + 1) * BLOCK_M - 1) // GROUP + 1)
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < kv_end
        slots = tl.load(req_to_token_ptr + row * stride_rt + pos, mask=nmask, other=0).to(tl.int64)
        kv_offs = slots[:, None] * stride_ct + kv_head * stride_ch + dims[None, :]
        kv_mask = nmask[:, None] & dmask[None, :]
        # Through float32: exact from 8-bit floats too (kv_store.from_cache_dtype's reason).
        # NOTE: no jit helpers in this loop: the interpreter spends more on each call than on
        # the tile products.
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(tl.float32).to(q.dtype)
        if USE_DOT:
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        else:  # as in batch_invariant_gemm: summed over D in order wherever it sits
            scores = tl.sum(q.to(tl.float32)[:, :, None] * tl.trans(k).to(tl.float32)[None, :, :], axis=1)
        scores = scores * sm_scale  # [M, N]
        # A real row's mask is its causal one alone (pos <= q_pos < kv_end), in every batch.
        scores = tl.where(nmask[None, :] & (pos[None, :] <= q_pos[:, None]), scores, float("-inf"))
        # Every row sees key 0, so after the first block m is finite and no exp gives NaN.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if USE_DOT:
            acc = tl.dot(p.to(q.dtype), v, acc, input_precision=DOT_PRECISION)
        else:
            acc += tl.sum(p.to(q.dtype).to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m = m_new

    # A row with no keys (a CUDA graph's padding) gets zeros.
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    out_offs = (start + tok[:, None]) * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & dmask[None, :])


def attention_blocks(device: torch.device, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): a function of the device and dtype only, never of the batch."""
    if device.type != "cuda":
        return 32, 32
    return (32, 32) if dtype == torch.float32 else (16, 128)


def deterministic_attention(
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
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """q: [T, H, D] (head dim contiguous), the new tokens of B requests back to back: request
    b owns rows extend_starts[b] : extend_starts[b] + extend_lens[b] (a decode: one row each).
    k_cache, v_cache: [slots, Hkv, D] contiguous, already holding every key of every request;
    req_to_token row req_pool_indices[b] lists them; seq_lens[b] = prefix + extend_lens[b].
    `max_extend_len` (a host int >= every extend_lens[b]) sizes the grid. Returns out [T, H, D]
    in q's dtype; a request with seq_lens[b] == 0 (padding) gets zeros. `config` (BLOCK_M,
    BLOCK_N and launch options, default attention_blocks') is for benchmarks: a token's output
    is invariant under any one config, not across configs."""
    t, heads, dim = q.shape
    check_paged_inputs("deterministic_attention", q, k_cache, v_cache, req_to_token, "T")
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    batch = seq_lens.shape[0]
    if t == 0 or batch == 0 or max_extend_len <= 0:
        return out
    block_m, block_n = attention_blocks(q.device, q.dtype)
    config = {"BLOCK_M": block_m, "BLOCK_N": block_n, **(config or {})}
    group = heads // kv_heads
    grid = (batch, kv_heads, triton.cdiv(max_extend_len * group, config["BLOCK_M"]))
    _attention_kernel[grid](
        q, k_cache, v_cache, out,
        req_to_token, req_pool_indices, seq_lens, extend_lens, extend_starts,
        sm_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        GROUP=group, HEAD_DIM=dim, USE_DOT=q.is_cuda,
        DOT_PRECISION=dot_precision(q.dtype),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), **config,
    )
    return out
