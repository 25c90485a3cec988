"""Llama (2, 3, 3.1) dense causal LM; Qwen2 and Qwen3 are the same network with small switches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rollout.engine.attention import Attention
from rollout.engine.forward_batch import ForwardBatch
from rollout.models.layers import RMSNorm, RotaryEmbedding, SiluAndMulMLP
from rollout.models.weights import WeightMapper


class DecoderAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary = RotaryEmbedding(config, self.head_dim)
        self.attn = Attention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # x: [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v.contiguous(), fb)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, qkv_bias, o_bias, qk_norm)
        self.mlp = SiluAndMulMLP(
            config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, fb: ForwardBatch):
        # x, residual: [T, hidden]; residual is None for the first layer.
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, o_bias, qk_norm) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, fb: ForwardBatch) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, fb)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    qkv_bias = False  # Qwen2 has biases on q, k, v (and never on o)
    qk_norm = False  # Qwen3 normalises each head of q and k before rotary

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias or attention_bias
        o_bias = attention_bias and not self.qkv_bias
        self.model = DecoderModel(config, qkv_bias, o_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.mapper = WeightMapper(self)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final-norm hidden states [T, hidden]."""
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the (fused) parameters; returns the names loaded."""
        return self.mapper.load(weights)

    def hf_param_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every HF name this model accepts, with the shape and dtype it must have."""
        return self.mapper.expected()
