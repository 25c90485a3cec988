"""Attention in plain PyTorch: simple, runs anywhere, the correctness oracle.

Decode attends for the whole batch at once over K/V gathered into a padded [B, S] layout;
extend goes one request at a time (each has its own causal block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rollout.forward.attention.base import Attention, AttentionBackend
from rollout.forward.forward_batch import ForwardBatch, ForwardMode

# cuDNN's SDPA rebuilds its graph for every new shape: milliseconds of host time per call.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, fb: ForwardBatch) -> None:
        max_len = max(fb.seq_lens_cpu)
        # [B, S] KV slots of every request, padded with slot 0 (never a real token).
        positions = torch.arange(max_len, device=fb.seq_lens.device)
        self.valid = positions[None, :] < fb.seq_lens[:, None]  # [B, S]
        rows = fb.req_to_token[fb.req_pool_indices, :max_len]
        self.slots = torch.where(self.valid, rows, torch.zeros_like(rows))

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not kv_stored:
            fb.kv_pool.store(layer.layer_id, fb.out_cache_loc, k, v)
        k_cache, v_cache = fb.kv_pool.k[layer.layer_id], fb.kv_pool.v[layer.layer_id]
        if fb.mode is ForwardMode.DECODE:
            return self._decode(q, k_cache, v_cache, layer)
        return self._extend(q, k_cache, v_cache, layer, fb)

    def _decode(self, q, k_cache, v_cache, layer: Attention) -> torch.Tensor:
        # Plain matmuls: one new token per request needs no fused kernel.
        b, group = q.shape[0], layer.num_heads // layer.num_kv_heads
        keys = k_cache[self.slots].float()  # [B, S, Hkv, D]
        values = v_cache[self.slots].float()
        query = q.float().reshape(b, layer.num_kv_heads, group, layer.head_dim)
        scores = torch.einsum("bhgd,bshd->bhgs", query, keys) * layer.scaling
        scores = scores.masked_fill(~self.valid[:, None, None, :], float("-inf"))
        out = torch.einsum("bhgs,bshd->bhgd", scores.softmax(dim=-1), values)
        return out.reshape(b, layer.num_heads, layer.head_dim).to(q.dtype)

    def _extend(self, q, k_cache, v_cache, layer: Attention, fb: ForwardBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for i, (seq_len, ext) in enumerate(zip(fb.seq_lens_cpu, fb.extend_lens_cpu)):
            slots = self.slots[i, :seq_len]
            group = layer.num_heads // layer.num_kv_heads
            keys = k_cache[slots].to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
            values = v_cache[slots].to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1)
            query = q[start : start + ext].transpose(0, 1)  # [H, E, D]
            # Query j sits at absolute position seq_len - ext + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            with sdpa_kernel(_SDPA_BACKENDS):
                attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=layer.scaling)
            out[start : start + ext] = attn.transpose(0, 1)
            start += ext
        return out
