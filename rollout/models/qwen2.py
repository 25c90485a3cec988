"""Qwen2 / Qwen2.5: Llama with biases on the q, k, v projections (none on o)."""

from __future__ import annotations

from rollout.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
