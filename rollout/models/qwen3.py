"""Qwen3 (dense): Llama with per-head RMSNorm on q and k, and an explicit head_dim."""

from __future__ import annotations

from rollout.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
