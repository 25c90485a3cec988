"""Llama (2, 3, 3.1) dense causal LM; Qwen2 and Qwen3 are the same network with small switches.

Built with a TPGroup of size k, each rank holds its part of every layer: 1/k of the query heads
and of the KV heads (or the one KV head its query heads use, when there are fewer KV heads than
ranks), 1/k of the MLP's intermediate features and of the vocabulary. Names and shapes seen
from outside (`hf_param_shapes`, `load_weights`) stay the checkpoint's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from rollout.forward.all_reduce_norm import AllReduceNorm
from rollout.forward.attention import Attention
from rollout.forward.forward_batch import ForwardBatch
from rollout.forward.tensor_parallel import SINGLE, Shard, TPGroup
from rollout.models.layers import (
    FusedOps,
    MergedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMulMLP,
    apply_rotary,
)
from rollout.models.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, vocab_logits
from rollout.models.weight_map import map_hf_names, target_view

# Checkpoint tensors that hold nothing to load (some older Llama checkpoints carry them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def local_heads(config: Any, tp: TPGroup) -> tuple[tuple[int, int], tuple[int, int]]:
    """[start, stop) of the query heads and of the KV heads that rank `tp.rank` holds.
    ValueError when the heads cannot be split over `tp.size` ranks."""
    heads = tp.even_range(config.num_attention_heads, "num_attention_heads")
    return heads, tp.kv_head_range(config.num_attention_heads, num_kv_heads_of(config))


class DecoderAttention(FusedOps, nn.Module):
    def __init__(
        self,
        config: Any,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        d = self.head_dim = head_dim_of(config)
        (h0, h1), (k0, k1) = local_heads(config, tp)
        self.num_heads, self.num_kv_heads = h1 - h0, k1 - k0  # this rank's
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        # The checkpoint's rows of each projection, and the slice of them this rank keeps.
        q_rows, kv_rows = config.num_attention_heads * d, num_kv_heads_of(config) * d
        parts = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        shards = {
            "q_proj": (h0 * d, h1 * d),
            "k_proj": (k0 * d, k1 * d),
            "v_proj": (k0 * d, k1 * d),
        }
        self.qkv_proj = MergedLinear(config.hidden_size, parts, qkv_bias, shards)
        self.o_proj = RowParallelLinear(q_rows, config.hidden_size, o_bias, tp)
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
            norm = (
                None
                if self.q_norm is None
                else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            )
            return self.o_proj(self.attn(q, k, v, fb, rope=rope, qk_norm=norm))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return self.o_proj(self.attn(q, k, v, fb))


class DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TPGroup
    ) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, layer_id, qkv_bias, o_bias, qk_norm, tp)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = SiluAndMulMLP(config.hidden_size, config.intermediate_size, mlp_bias, tp)
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
    def __init__(
        self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp: TPGroup
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, qkv_bias, o_bias, qk_norm, tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def defer_all_reduces(self, all_reduce: AllReduceNorm) -> None:
        """Each row-parallel projection (o_proj, down_proj) hands on its partial sums, and the
        norm after it sums them over the group as it adds the residual: with `all_reduce`'s
        fused kernel, one launch for the three; with its symmetric sum, the projection writes
        straight into the buffer summed in place (forward/all_reduce_norm.py)."""
        for i, layer in enumerate(self.layers):
            for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
                projection.reduce = False
                # Only a symmetric sum has a buffer to write into: else nothing to ask per call.
                projection.out_for = all_reduce.out_for if all_reduce.symmetric is not None else None
            layer.post_attention_layernorm.all_reduce = all_reduce
            if i > 0:  # layer 0's input is the embedding, summed by embed_tokens
                layer.input_layernorm.all_reduce = all_reduce
        self.norm.all_reduce = all_reduce

    def lora_delta_consumers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(projection, the module its output goes to first) for each projection whose LoRA
        delta that module can add as it reads the output (LoraLayer.defers): gate/up's to
        SiLU-and-mul, and at tp 1 o_proj's and down_proj's to the norm after them (a partial
        sum's delta must be added before the all-reduce)."""
        pairs: list[tuple[nn.Module, nn.Module]] = []
        before = None  # the down_proj whose output the next norm reads
        for layer in self.layers:
            mlp, attn = layer.mlp, layer.self_attn
            pairs.append((mlp.gate_up_proj, mlp))
            if attn.o_proj.tp.size > 1:
                continue
            if before is not None:
                pairs.append((before, layer.input_layernorm))
            pairs.append((attn.o_proj, layer.post_attention_layernorm))
            before = mlp.down_proj
        if before is not None:
            pairs.append((before, self.norm))
        return pairs

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
    """The causal LM over one tensor-parallel rank's part of the weights (all of them at tp=1).

    What the engine sizes this rank's KV pool and attention backend by (the same on every
    layer): `num_local_heads` query heads and `num_local_kv_heads` KV heads of `head_dim`
    each. `forward` stores exactly that many KV heads per token; `compute_logits` returns the
    full vocabulary on every rank."""

    qkv_bias = False  # Qwen2 has biases on q, k, v (and never on o)
    qk_norm = False  # Qwen3 normalises each head of q and k before rotary
    has_lm_head = True  # sequence classifiers put a score head on the same body instead

    def __init__(self, config: Any, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        (h0, h1), (k0, k1) = local_heads(config, tp)
        self.num_local_heads, self.num_local_kv_heads = h1 - h0, k1 - k0
        self.head_dim = head_dim_of(config)
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = self.qkv_bias or attention_bias
        o_bias = attention_bias and not self.qkv_bias
        self.model = DecoderModel(config, qkv_bias, o_bias, self.qk_norm, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings or not self.has_lm_head
            else ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        )
        self._hf_targets = map_hf_names(self)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 laid out as in `fb` -> hidden states after the final
        norm, [T, hidden] (the same on every rank). Stores every layer's K/V of these tokens
        (this rank's KV heads) at `fb.out_cache_loc`."""
        return self.model(input_ids, positions, fb)

    def lora_delta_consumers(self) -> list[tuple[nn.Module, nn.Module]]:
        return self.model.lora_delta_consumers()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] float32, the whole vocabulary on every rank."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return vocab_logits(
            hidden, weight, self.config.vocab_size, self.tp, self.skinny_rows, self.batch_invariant
        )

    def hf_param_shapes(
        self, local: bool = False
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every HF name `load_weights` loads, with the shape and dtype it lands in; a caller
        validates a whole update against it before any parameter changes. Shapes are the
        checkpoint's full shapes on every rank; with `local`, this rank's slices instead (what
        `load_weights(..., presharded=True)` takes). Names that are accepted but ignored (see
        `is_ignored_weight`) are not listed."""
        out = {}
        for hf_name, target in self._hf_targets.items():
            param = self.get_parameter(target.param)
            shape = tuple(target_view(param, target).shape) if local else target.shape
            out[hf_name] = (shape, param.dtype)
        return out

    def hf_shard(self, hf_name: str) -> Shard | None:
        """The slice (dim, start, stop) of the full checkpoint tensor `hf_name` that this rank
        holds; None when it holds the whole tensor (always at tp=1), or for a name it does not
        load (ignored or unknown: `load_weights` decides what to do with those)."""
        target = self._hf_targets.get(hf_name)
        return None if target is None else target.shard

    def is_ignored_weight(self, hf_name: str) -> bool:
        """True for names load_weights accepts and skips: rotary buffers, and `lm_head.weight`
        when the head is tied to the embedding (it then holds the embedding's values)."""
        tied_head = self.tie_word_embeddings and hf_name == "lm_head.weight"
        return tied_head or hf_name.endswith(_IGNORED_SUFFIXES)

    def hf_weight(self, hf_name: str) -> torch.Tensor:
        """The live view of this rank's slice of `hf_name` (all of it at tp=1) inside its
        (possibly fused) parameter: reading it gives what is loaded, writing it changes the
        model. KeyError for a name this model lacks (ignored names included: they have no
        storage here)."""
        if hf_name not in self._hf_targets:
            raise KeyError(f"unknown parameter {hf_name!r} for {type(self).__name__}")
        target = self._hf_targets[hf_name]
        return target_view(self.get_parameter(target.param), target)

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], presharded: bool = False
    ) -> set[str]:
        """Copies HF-named tensors into the (fused) parameters, casting dtype and device, and
        returns the names loaded. Tensors are full checkpoint tensors, of which this rank
        copies its slice (`hf_shard`); with `presharded`, each is already this rank's slice
        (shaped as `hf_param_shapes(local=True)` says). Any subset of names may be given: only
        those rows change. Each tensor is checked just before it is copied, so an error midway
        leaves the earlier ones loaded; validate against `hf_param_shapes` first for an
        all-or-nothing update. Raises KeyError for a name this model lacks, ValueError for a
        wrong shape."""
        loaded = set()
        for hf_name, tensor in weights:
            if self.is_ignored_weight(hf_name):
                continue
            dest = self.hf_weight(hf_name)
            shard = self._hf_targets[hf_name].shard
            expected = tuple(dest.shape) if presharded else self._hf_targets[hf_name].shape
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"shape mismatch for {hf_name!r}: expected {list(expected)}, "
                    f"got {list(tensor.shape)}"
                    + (" (this rank's slice)" if presharded and shard is not None else "")
                )
            dest.copy_(tensor if presharded or shard is None else shard.take(tensor))
            loaded.add(hf_name)
        return loaded
