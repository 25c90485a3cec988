"""Llama (2, 3, 3.1) dense causal LM; Qwen2 and Qwen3 are the same network with small switches."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rollout.forward.attention import Attention
from rollout.forward.forward_batch import ForwardBatch
from rollout.models.layers import (
    FusedOps,
    Linear,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    SiluAndMulMLP,
    apply_rotary,
    logits_linear,
)

# Checkpoint tensors that hold nothing to load (some older Llama checkpoints carry them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DecoderAttention(FusedOps, nn.Module):
    def __init__(
        self, config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        parts = {"q_proj": self.q_size, "k_proj": self.kv_size, "v_proj": self.kv_size}
        self.qkv_proj = MergedLinear(config.hidden_size, parts, qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], fb: ForwardBatch
    ) -> torch.Tensor:
        # x: [T, hidden]; rope: (cos, sin) [T, 1, head_dim/2] -> [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        # q, k, v may be strided views of the qkv output: the kernels read them in place.
        if self.fused:
            # One launch norms (Qwen3) and rotates q and k and stores k and v.
            norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return self.o_proj(self.attn(q, k, v, fb, rope=rope, qk_norm=norm))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(self.attn(q, k, v, fb))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, qkv_bias, o_bias, qk_norm)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = SiluAndMulMLP(config.hidden_size, config.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # x, residual: [T, hidden]. The residual add is deferred into the next norm, so a
        # layer returns its output and the running sum separately; None before layer 0.
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, o_bias, qk_norm)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        # input_ids, positions: [T] -> [T, hidden]
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary_emb(positions)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, fb)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(FusedOps, nn.Module):
    qkv_bias = False  # Qwen2 has biases on q, k, v (and never on o)
    qk_norm = False  # Qwen3 normalises each head of q and k before rotary
    has_lm_head = True  # sequence classifiers put a score head on the same body instead

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias or attention_bias
        o_bias = attention_bias and not self.qkv_bias
        self.model = DecoderModel(config, qkv_bias, o_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings or not self.has_lm_head
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._hf_targets = self._map_hf_names()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 laid out as in `fb` -> hidden states after the final
        norm, [T, hidden]. Stores every layer's K/V of these tokens at `fb.out_cache_loc`."""
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return logits_linear(hidden, weight, self.skinny_rows)

    def hf_param_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every HF name `load_weights` loads, with the shape and dtype it lands in; a caller
        validates a whole update against it before any parameter changes. Names that are
        accepted but ignored (see `is_ignored_weight`) are not listed."""
        out = {}
        for hf_name, (name, _, rows) in self._hf_targets.items():
            param = self.get_parameter(name)
            shape = tuple(param.shape) if rows is None else (rows, *param.shape[1:])
            out[hf_name] = (shape, param.dtype)
        return out

    def is_ignored_weight(self, hf_name: str) -> bool:
        """True for names load_weights accepts and skips: rotary buffers, and `lm_head.weight`
        when the head is tied to the embedding (it then holds the embedding's values)."""
        tied_head = self.tie_word_embeddings and hf_name == "lm_head.weight"
        return tied_head or hf_name.endswith(_IGNORED_SUFFIXES)

    def hf_weight(self, hf_name: str) -> torch.Tensor:
        """The live view of `hf_name`'s values inside its (possibly fused) parameter: reading it
        gives what is loaded, writing it changes the model. KeyError for a name this model lacks
        (ignored names included: they have no storage here)."""
        if hf_name not in self._hf_targets:
            raise KeyError(f"unknown parameter {hf_name!r} for {type(self).__name__}")
        name, start, rows = self._hf_targets[hf_name]
        dest = self.get_parameter(name).data
        return dest if rows is None else dest[start : start + rows]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies HF-named tensors into the (fused) parameters, casting dtype and device, and
        returns the names loaded. Any subset of names may be given: only those rows change.
        Each tensor is checked just before it is copied, so an error midway leaves the earlier
        ones loaded; validate against `hf_param_shapes` first for an all-or-nothing update.
        Raises KeyError for a name this model lacks, ValueError for a wrong shape."""
        loaded = set()
        for hf_name, tensor in weights:
            if self.is_ignored_weight(hf_name):
                continue
            dest = self.hf_weight(hf_name)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(
                    f"shape mismatch for {hf_name!r}: expected {list(dest.shape)}, "
                    f"got {list(tensor.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(hf_name)
        return loaded

    def _map_hf_names(self) -> dict[str, tuple[str, int, int | None]]:
        """HF name -> (our parameter, first row, rows); rows None means the whole parameter."""
        targets = {}
        for module_name, module in self.named_modules():
            for kind, _ in module.named_parameters(recurse=False):
                name = f"{module_name}.{kind}"
                if not isinstance(module, MergedLinear):
                    targets[name] = (name, 0, None)
                    continue
                parent = module_name.rpartition(".")[0]
                for part, (start, rows) in module.part_rows().items():
                    targets[f"{parent}.{part}.{kind}"] = (name, start, rows)
        return targets
