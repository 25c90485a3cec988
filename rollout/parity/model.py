"""ParityModel: a trainer's forward over a Hugging Face causal LM's own parameters that
computes the per-token logprobs an engine with deterministic inference reports, bit for bit.

It runs, op for op, what the engine's forward runs under enable_deterministic_inference: the
batch-invariant GEMM for every projection and the LM head, the engine's RMSNorm (with the
residual add deferred into the next norm), rotary (with Qwen3's per-head norm) and SiLU-and-mul
kernels, and the engine's attention kernel over the sequence's own K/V. Every one of those
kernels gives a token the same bits whatever else is batched, so a trainer that scores
trajectories here gets the logprobs the engine sampled them with, and a logprob gap of 0.
Backward goes through the torch formula of each op (rollout.parity.ops), so the parameters
train as usual; they are the HF model's own tensors, never copies.

The bits agree with an engine that runs enable_deterministic_inference on the same kind of
device, in the same dtype, at tp_size 1 and with kv_cache_dtype auto (an 8-bit KV cache rounds
keys and values that this model keeps whole).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.models.layers import RotaryEmbedding
from rollout.parity import ops

# The decoder families whose HF modules this model reads (Llama, Qwen2, Qwen3 layouts).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class ParityModel(nn.Module):
    def __init__(self, hf_model: nn.Module) -> None:
        """Wraps `hf_model` (a *ForCausalLM of SUPPORTED_MODEL_TYPES) without copying its
        parameters: training either trains both."""
        super().__init__()
        config = hf_model.config
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"ParityModel supports model types {', '.join(SUPPORTED_MODEL_TYPES)}, "
                f"got {config.model_type!r}"
            )
        self.hf = hf_model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = config.rms_norm_eps
        device = next(hf_model.parameters()).device
        with torch.device(device):
            self.rotary = RotaryEmbedding(config, self.head_dim)  # the engine's frequencies

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> ParityModel:
        """Loads the HF checkpoint at `path` (as transformers does) and wraps it."""
        from transformers import AutoModelForCausalLM

        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device))

    def forward(self, sequences: Sequence[Sequence[int]] | torch.Tensor) -> list[torch.Tensor]:
        """sequences: token ids, one list (or 1-d tensor) per sequence, any lengths >= 1.
        Returns, per sequence, [len - 1] float32 logprobs: entry i is log p(token i+1 | tokens
        0..i), which is what the engine reports for token i+1 (a prompt logprob, or a sampled
        token's)."""
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) < 1:
            raise ValueError(
                f"ParityModel needs sequences of at least one token, got lengths {lengths}"
            )
        device = self.rotary.inv_freq.device
        ids = torch.cat(
            [torch.as_tensor(s, dtype=torch.int64, device=device).reshape(-1) for s in sequences]
        )
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])
        logprobs = torch.log_softmax(self.logits(ids, positions, lengths), dim=-1)  # [T, V]
        out, start = [], 0
        for n in lengths:
            rows = torch.arange(start, start + n - 1, device=device)
            out.append(logprobs[rows, ids[start + 1 : start + n]])
            start += n
        return out

    def padded_token_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """The HF-style batch: input_ids, attention_mask [B, L], each row right-padded ->
        [B, L-1] logprobs as `forward` gives them, 0 past each row's length."""
        lengths = attention_mask.sum(dim=1).tolist()
        for row, n in enumerate(lengths):
            if n < 1 or not bool(attention_mask[row, :n].all()):
                raise ValueError(
                    f"padded_token_logprobs needs right-padded rows of at least one token; row "
                    f"{row} has mask {attention_mask[row].tolist()}"
                )
        logprobs = self([input_ids[row, :n] for row, n in enumerate(lengths)])
        width = input_ids.shape[1] - 1
        return torch.stack([F.pad(lp, (0, width - lp.shape[0])) for lp in logprobs])

    def logits(
        self, ids: torch.Tensor, positions: torch.Tensor, lengths: list[int]
    ) -> torch.Tensor:
        """ids, positions: [T] for sequences of `lengths` back to back -> float32 logits [T, V]."""
        body = self.hf.model
        x, residual = body.embed_tokens(ids), None  # [T, hidden]
        cos, sin = self.rotary(positions)
        for layer in body.layers:
            x, residual = ops.rms_norm_residual(x, residual, layer.input_layernorm.weight, self.eps)
            x = self._attention(layer.self_attn, x, cos, sin, lengths)
            x, residual = ops.rms_norm_residual(
                x, residual, layer.post_attention_layernorm.weight, self.eps
            )
            x = self._mlp(layer.mlp, x)
        x, _ = ops.rms_norm_residual(x, residual, body.norm.weight, self.eps)
        return ops.linear(x, self._lm_head_weight(), out_dtype=torch.float32)

    def _attention(self, attn: Any, x: torch.Tensor, cos, sin, lengths: list[int]) -> torch.Tensor:
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        qkv = ops.fused_linear(x, [p.weight for p in projs], [p.bias for p in projs])
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        q, k, v = ops.rotary_qkv(
            qkv, (self.num_heads, self.num_kv_heads, self.head_dim), cos, sin,
            None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
            self.eps,
        )  # fmt: skip
        out = ops.causal_attention(q, k, v, lengths, self.head_dim**-0.5)
        return ops.fused_linear(
            out.reshape(x.shape[0], -1), [attn.o_proj.weight], [attn.o_proj.bias]
        )

    def _mlp(self, mlp: Any, x: torch.Tensor) -> torch.Tensor:
        gate_up = ops.fused_linear(
            x, [mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias]
        )
        return ops.fused_linear(ops.silu_mul(gate_up), [mlp.down_proj.weight], [mlp.down_proj.bias])

    def _lm_head_weight(self) -> torch.Tensor:
        head = self.hf.get_output_embeddings()
        return self.hf.model.embed_tokens.weight if head is None else head.weight
