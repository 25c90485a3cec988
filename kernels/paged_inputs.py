"""The checks the paged attention kernels make of their inputs before launching."""

from __future__ import annotations

import torch


def check_paged_inputs(
    kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    req_to_token: torch.Tensor, tokens: str,
) -> None:  # fmt: skip
    """q: [tokens, H, D] with its head dim contiguous; caches: [slots, Hkv, D] contiguous with H
    a multiple of Hkv; req_to_token rows contiguous. ValueError naming `kernel` otherwise."""
    heads, dim = q.shape[1:]
    kv_heads = k_cache.shape[1]
    if heads % kv_heads or k_cache.shape[2] != dim or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"{kernel} needs q [{tokens}, H, D] and caches [slots, Hkv, D] with H a multiple "
            f"of Hkv; got q {tuple(q.shape)}, caches {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{kernel} needs q's head dim and both caches contiguous")
    if req_to_token.stride(-1) != 1:
        raise ValueError(f"{kernel} needs req_to_token rows contiguous")
