"""Attention with the Triton kernels of `rollout_kernels`: paged decode with split-KV, paged
extend over the cached prefix, and the KV store, one launch each per layer for the whole batch.

The kernels read each request's KV slots straight from req_to_token, so there is no page list
to build: per-forward metadata (where each request's new tokens start, the decode split count)
comes from host-side lengths in `prepare`, and no layer waits on the device.
"""

from __future__ import annotations

import torch

from rollout.forward.attention.base import (
    Attention,
    AttentionBackend,
    AttentionShape,
    GraphRows,
)
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout_kernels.decode_attention import choose_num_splits, decode_attention
from rollout_kernels.extend_attention import extend_attention
from rollout_kernels.interpreter import interpreting
from rollout_kernels.kv_store import store_kv


class TritonAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, shape: AttentionShape, decode_piece_keys: int | None = None) -> None:
        """decode_piece_keys: a decode cuts each request's keys into one piece per this many
        (the kernel's MIN_KEYS_PER_SPLIT by default: short pieces, for small batches)."""
        device = torch.device(shape.device)
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"attention_backend='triton' needs a CUDA device, got {device}; use "
                "attention_backend='torch' there (or TRITON_INTERPRET=1 to interpret the kernels, slowly)"
            )
        self.shape = shape
        self.decode_piece_keys = decode_piece_keys
        # A graph's split count: it replays the launch shape it captured, for any length (each
        # request is still cut by its own length, as in an eager step).
        self._graph_splits = choose_num_splits(shape.max_context_len, decode_piece_keys)
        # What the next forward's kernels read: fb's own tensors, or the graph buffers below.
        self.seq_lens: torch.Tensor | None = None  # [B] int64
        self.req_rows: torch.Tensor | None = None  # [B] int64 rows of req_to_token
        self.num_splits = 1
        self._graph_rows: GraphRows | None = None  # made at the first capture

    def prepare(self, fb: ForwardBatch) -> None:
        self.seq_lens, self.req_rows = fb.seq_lens, fb.req_pool_indices
        if fb.mode is ForwardMode.DECODE:
            # With pieces of its own (large batches, past the largest graph among them), every
            # decode launches the graphs' shape: the one variant the warm-up compiled, whatever
            # the lengths (a request's result is the same from its own cut on).
            if self.decode_piece_keys is None:
                self.num_splits = choose_num_splits(max(fb.seq_lens_cpu))
            else:
                self.num_splits = self._graph_splits
            return
        self.extend_starts = torch.cumsum(fb.extend_lens, 0) - fb.extend_lens  # [B], on the device
        self.max_extend_len = max(fb.extend_lens_cpu)

    def prepare_graph(self, padded_batch_size: int, fb: ForwardBatch | None) -> None:
        """Padding rows get 0 keys: the decode kernel writes zeros for them and reads no KV."""
        if self._graph_rows is None:
            self._graph_rows = GraphRows(self.shape)
        self.seq_lens, self.req_rows = self._graph_rows.fill(padded_batch_size, fb)
        self.num_splits = self._graph_splits

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        k_cache, v_cache = fb.kv_pool.k[layer.layer_id], fb.kv_pool.v[layer.layer_id]
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, fb.out_cache_loc)
        if fb.mode is ForwardMode.DECODE:
            return decode_attention(
                q, k_cache, v_cache, fb.req_to_token, self.req_rows, self.seq_lens,
                layer.scaling, num_splits=self.num_splits,
                min_keys_per_split=self.decode_piece_keys,
            )  # fmt: skip
        return extend_attention(
            q, k_cache, v_cache, fb.req_to_token, self.req_rows, self.seq_lens,
            fb.extend_lens, self.extend_starts, self.max_extend_len, layer.scaling,
        )
