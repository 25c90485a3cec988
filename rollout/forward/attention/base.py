"""The attention-backend contract.

Models never touch KV memory directly: each attention layer hands its projected q, k, v to
the backend of the current ForwardBatch, which stores the new tokens' K/V at
`fb.out_cache_loc` and attends over each request's whole sequence (cached prefix + new
tokens, causal among the new ones). Backends differ only in how they do that; the
scheduler and the models are the same for all of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from rollout.forward.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionShape:
    """What a backend may size its buffers and plans by: the same for every layer of a model."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    dtype: torch.dtype
    device: torch.device
    max_batch_size: int  # most requests in one forward
    max_context_len: int  # most tokens in one request's KV
    kv_dtype: torch.dtype | None = None  # the KV cache's element type; None: dtype
    # Most requests in one CUDA graph replay (None: max_batch_size); larger batches run eagerly.
    max_graph_batch_size: int | None = None
    # The largest extend replayed from a graph: its new tokens over at most this many requests.
    max_graph_extend_tokens: int = 0
    max_graph_extend_requests: int = 0

    @property
    def graph_batch_size(self) -> int:
        if self.max_graph_batch_size is None:
            return self.max_batch_size
        return min(self.max_graph_batch_size, self.max_batch_size)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


class GraphRows:
    """Fixed-address seq_lens and req_to_token rows for the paged Triton kernels under CUDA
    graphs: a replay reads the first padded_batch_size entries, the real requests' and then
    padding rows of 0 keys (the kernels read no KV for them and write zeros)."""

    def __init__(self, shape: AttentionShape) -> None:
        n, device = shape.max_batch_size, shape.device
        self.seq_lens = torch.zeros(n, dtype=torch.int64, device=device)
        self.req_rows = torch.zeros(n, dtype=torch.int64, device=device)

    def fill(
        self, padded_batch_size: int, fb: ForwardBatch | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes fb's requests (None: none, at capture) and the padding; returns the views
        (seq_lens, req_rows) of padded_batch_size entries."""
        n = self.seq_lens.shape[0]
        if padded_batch_size > n:
            raise ValueError(f"graph batch size {padded_batch_size} exceeds max_batch_size {n}")
        real = 0 if fb is None else fb.batch_size
        if fb is not None:
            self.seq_lens[:real].copy_(fb.seq_lens)
            self.req_rows[:real].copy_(fb.req_pool_indices)
        self.seq_lens[real:padded_batch_size].zero_()
        self.req_rows[real:padded_batch_size].zero_()
        return self.seq_lens[:padded_batch_size], self.req_rows[:padded_batch_size]


class AttentionBackend(ABC):
    # Backends whose decode can be captured in a CUDA graph set this and implement prepare_graph.
    supports_cuda_graph = False
    # Backends whose extend can be captured set this and implement prepare_extend_graph.
    supports_extend_graph = False

    def prepare(self, fb: ForwardBatch) -> None:
        """Called once per forward before any layer runs: build per-batch metadata here."""

    def prepare_graph(self, padded_batch_size: int, fb: ForwardBatch | None) -> None:
        """Instead of `prepare`, before a decode of `padded_batch_size` rows is captured into
        (fb None: every row is padding) or replayed from a CUDA graph. The first fb.batch_size
        rows are fb's requests; the rest are padding that attends to KV slot 0 only. Whatever
        the captured kernels read must sit at addresses fixed per padded_batch_size."""
        raise NotImplementedError(f"{type(self).__name__} cannot run inside a CUDA graph")

    def prepare_extend_graph(self, tokens: int, requests: int, fb: ForwardBatch | None) -> None:
        """Instead of `prepare`, before an extend of `tokens` new tokens (a bucket's size) over
        `requests` request slots is captured into (fb None: every token is padding) or replayed
        from a CUDA graph. fb's requests take the first slots and the first sum(extend_lens)
        tokens; the remaining tokens are padding whose K/V go to slot 0, which they alone
        attend to; the slots between hold no tokens. Whatever the captured kernels read must
        sit at addresses fixed per (tokens, requests)."""
        raise NotImplementedError(f"{type(self).__name__} cannot capture an extend")

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """q: [T, H, D], k and v: [T, Hkv, D] for the new tokens, possibly strided views (the
        head dim is contiguous). Stores k, v in the KV pool for `layer.layer_id` (unless
        kv_stored: the caller's rotary launch already did), then returns the attention output
        [T, H, D]."""


class Attention(nn.Module):
    """The attention op of one layer; the model does projections, norms and rotary itself."""

    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fb: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D], any token and head strides (views into a fused qkv
        projection's output), the head dim contiguous -> [T, H*D].

        With rope = (cos, sin) (the fused-kernel path, backends other than torch), q and k
        arrive unrotated: one launch norms them (qk_norm = (q weight, k weight, eps), Qwen3),
        rotates them in place and stores k and v in the KV pool, so the backend only attends."""
        kv_stored = rope is not None
        if kv_stored:
            from rollout_kernels.rotary import apply_rotary_inplace

            store = (v, fb.kv_pool.k[self.layer_id], fb.kv_pool.v[self.layer_id], fb.out_cache_loc)
            apply_rotary_inplace(q, k, *rope, norm=qk_norm, store=store)
        out = fb.attn_backend.forward(q, k, v, self, fb, kv_stored=kv_stored)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
