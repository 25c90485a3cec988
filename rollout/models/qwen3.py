"""Qwen3 (dense): Llama with per-head RMSNorm on q and k before rotary, and a head_dim that
the config sets on its own (not hidden_size / heads)."""

from __future__ import annotations

from rollout.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
