"""Paged decode attention: one new query token per request over its whole KV history.

The keys of a request are cut into pieces, each attended by its own program (split-KV), so a
few long sequences still fill the GPU; `merge_attention_parts` then combines the pieces. How a
request is cut depends on its own length only (one piece per MIN_KEYS_PER_SPLIT keys, at most
MAX_SPLITS): its output is the same bit for bit whatever else is in the batch and whether the
step replays a CUDA graph or runs eagerly. One program serves all query heads that share a KV
head (GQA), so each K/V row is read once per group rather than once per query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout_kernels.attention_merge import merge_attention_parts
from rollout_kernels.kv_store import from_cache_dtype
from rollout_kernels.paged_inputs import check_paged_inputs
from rollout_kernels.pdl import launch_options, pdl_start
from rollout_kernels.precision import dot_precision

# One bf16 tile of keys per piece. A short request at a small batch then still spreads over
# many programs (with 256-key pieces most SMs sat idle at batch 1, and batch-1 Qwen2.5-7B
# decoded slower), and a batch of very different lengths splits into even work (the nano
# workload ran slower with 256-key pieces, or with longer pieces for larger batches:
# benchmarks/RESULTS.md, fourth session).
MIN_KEYS_PER_SPLIT = 64
MAX_SPLITS = 16
BLOCK_N = 64  # keys per loop step in 16-bit (32 in float32) unless a launch names its own
# Pieces of at least LONG_PIECE_KEYS keys step through them BLOCK_N_LONG keys at a time in 16-bit
# with head dims up to 128 (faster at the large decode batches that use long pieces:
# benchmarks/RESULTS.md, forty-third session).
LONG_PIECE_KEYS = 1024
BLOCK_N_LONG = 128


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, req_to_token_ptr, req_pool_ptr, seq_lens_ptr,
    part_ptr, lse_ptr,
    sm_scale,
    stride_qb, stride_qh, stride_ct, stride_ch, stride_rt,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_KEYS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pdl_start(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    row = tl.load(req_pool_ptr + b).to(tl.int64)
    # This request's own cut; programs past it find no keys and report an empty part.
    pieces = tl.minimum(tl.maximum(tl.cdiv(seq_len, MIN_KEYS), 1), NUM_SPLITS)
    split_len = tl.cdiv(seq_len, pieces)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    group = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + group
    hmask = group < GROUP
    if start >= end:
        # Past this request's cut (most programs of a short request in a launch sized for long
        # ones): lse = -inf before any load, and no part; the merge gives it no weight and does
        # not read it.
        empty = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, empty, mask=hmask)
        return
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    denom = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nmask = pos < end
        slots = tl.load(req_to_token_ptr + row * stride_rt + pos, mask=nmask, other=0).to(tl.int64)
        kv_offs = slots[:, None] * stride_ct + kv_head * stride_ch + dims[None, :]
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(from_cache_dtype(k, q.dtype)), input_precision=DOT_PRECISION) * sm_scale
        scores = tl.where(nmask[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), from_cache_dtype(v, q.dtype), input_precision=DOT_PRECISION)
        m = m_new

    # A piece holds at least one key here, so denom >= 1.
    out = acc / denom[:, None]
    part_offs = b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + dims[None, :]
    tl.store(part_ptr + part_offs, out, mask=hmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, m + tl.log(denom), mask=hmask)


def choose_num_splits(max_seq_len: int, min_keys_per_split: int | None = None) -> int:
    """The `num_splits` that cuts every request of a batch whose longest sequence has
    `max_seq_len` keys its own way (one piece per min_keys_per_split keys, by default
    MIN_KEYS_PER_SPLIT; at most MAX_SPLITS). A CUDA graph, which may replay for any length, uses
    choose_num_splits(max context)."""
    min_keys = MIN_KEYS_PER_SPLIT if min_keys_per_split is None else min_keys_per_split
    return max(1, min(MAX_SPLITS, triton.cdiv(max_seq_len, min_keys)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    min_keys_per_split: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """q: [B, H, D] (head dim contiguous), the query of each request's newest token;
    k_cache, v_cache: [slots, Hkv, D] contiguous; req_to_token: [rows, max_context] with the
    slots of request b's tokens in row req_pool_indices[b]; seq_lens: [B] keys per request
    (the newest token's K/V already stored). Returns out [B, H, D] in q's dtype; a request
    with no keys (a padding row) gets zeros.

    A request's keys are cut into one piece per `min_keys_per_split` keys (MIN_KEYS_PER_SPLIT by
    default; long pieces leave a short request whole and a long one in as many programs as it
    has pieces), and `num_splits` bounds the pieces: from choose_num_splits(its length,
    min_keys_per_split) on, the result is the same bit for bit; below, it differs by float
    rounding only. A fixed value keeps the launch shape fixed (CUDA graphs), whatever the
    sequence lengths.
    block_n (keys per loop step; 64, or 128 for pieces of LONG_PIECE_KEYS or more with head dims
    up to 128, or 32 in float32, by default; it also moves the rounding),
    num_warps and num_stages tune the launch (benchmarks/bench_attention.py --triton-configs)."""
    b, heads, dim = q.shape
    check_paged_inputs("decode_attention", q, k_cache, v_cache, req_to_token, "B")
    kv_heads = k_cache.shape[1]
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    min_keys = MIN_KEYS_PER_SPLIT if min_keys_per_split is None else min_keys_per_split
    if min_keys < 1:
        raise ValueError(f"min_keys_per_split must be >= 1, got {min_keys}")
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    group = heads // kv_heads
    parts = torch.empty((b, heads, num_splits, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, heads, num_splits), dtype=torch.float32, device=q.device)
    # tl.dot needs every tile dim >= 16; padded heads and dims are masked out.
    block_d = max(16, triton.next_power_of_2(dim))
    if block_n is None:
        long_pieces = min_keys >= LONG_PIECE_KEYS and block_d <= 128
        block_n = 32 if q.dtype == torch.float32 else BLOCK_N_LONG if long_pieces else BLOCK_N
    _decode_split_kernel[(b, kv_heads, num_splits)](
        q, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        parts, lse,
        sm_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
        GROUP=group, HEAD_DIM=dim, DOT_PRECISION=dot_precision(q.dtype), NUM_SPLITS=num_splits,
        MIN_KEYS=min_keys,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages, **launch_options(q),
    )
    merge_attention_parts(parts, lse, out)
    return out
