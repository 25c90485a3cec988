"""Attention in plain PyTorch, one request at a time: slow, simple, the correctness oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.engine.attention.base import Attention, AttentionBackend
from rollout.engine.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch
    ) -> torch.Tensor:
        fb.kv_pool.store(layer.layer_id, fb.out_cache_loc, k, v)
        k_cache, v_cache = fb.kv_pool.k[layer.layer_id], fb.kv_pool.v[layer.layer_id]
        group = layer.num_heads // layer.num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for i, (seq_len, ext) in enumerate(zip(fb.seq_lens_cpu, fb.extend_lens_cpu)):
            slots = fb.req_to_token[fb.req_pool_indices[i], :seq_len]
            # [S, Hkv, D] -> [H, S, D]
            keys = k_cache[slots].to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            values = v_cache[slots].to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            query = q[start : start + ext].transpose(0, 1)  # [H, E, D]
            # Query j sits at absolute position seq_len - ext + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            attn = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=layer.scaling
            )
            out[start : start + ext] = attn.transpose(0, 1)
            start += ext
        return out
