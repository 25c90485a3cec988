"""Attention for deterministic inference: one batch-invariant kernel
(rollout_kernels.deterministic_attention) for every step, prefill, chunks, cache-hit extends
and decode alike, so a token's attention output is the same bits whichever kind of step made
it and whatever else was batched with it.

A decode step is an extend of one token per request: its requests' rows start at 0, 1, 2, ...
Under a CUDA graph, padding rows get no keys and come out as zeros.
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
from rollout_kernels.deterministic_attention import deterministic_attention
from rollout_kernels.interpreter import interpreting
from rollout_kernels.kv_store import store_kv


class DeterministicAttentionBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, shape: AttentionShape) -> None:
        device = torch.device(shape.device)
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"deterministic inference runs its Triton kernels, which need a CUDA device, got "
                f"{device}; set TRITON_INTERPRET=1 to interpret them on the CPU (slowly)"
            )
        self.shape = shape
        n = shape.max_batch_size
        # A decode's rows: request b's one new token is row b. Fixed addresses for the graphs.
        self._rows = torch.arange(n, dtype=torch.int64, device=device)
        self._ones = torch.ones(n, dtype=torch.int64, device=device)
        self._graph_rows = GraphRows(shape)
        # What the next forward's kernels read: fb's own tensors, or the buffers above.
        self.seq_lens: torch.Tensor | None = None  # [B] int64
        self.req_rows: torch.Tensor | None = None  # [B] int64 rows of req_to_token
        self.extend_lens: torch.Tensor | None = None  # [B] int64
        self.extend_starts: torch.Tensor | None = None  # [B] int64, on the device
        self.max_extend_len = 0

    def prepare(self, fb: ForwardBatch) -> None:
        self.seq_lens, self.req_rows = fb.seq_lens, fb.req_pool_indices
        if fb.mode is ForwardMode.DECODE and fb.batch_size <= self._rows.shape[0]:
            self.extend_lens = self._ones[: fb.batch_size]
            self.extend_starts = self._rows[: fb.batch_size]
        else:
            self.extend_lens = fb.extend_lens
            self.extend_starts = torch.cumsum(fb.extend_lens, 0) - fb.extend_lens
        self.max_extend_len = max(fb.extend_lens_cpu, default=0)

    def prepare_graph(self, padded_batch_size: int, fb: ForwardBatch | None) -> None:
        """Padding rows get 0 keys: the kernel writes zeros for them and reads no KV."""
        self.seq_lens, self.req_rows = self._graph_rows.fill(padded_batch_size, fb)
        self.extend_lens = self._ones[:padded_batch_size]
        self.extend_starts = self._rows[:padded_batch_size]
        self.max_extend_len = 1

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: Attention,
        fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, Hkv, D] -> [T, H, D]
        k_cache, v_cache = fb.kv_pool.k[layer.layer_id], fb.kv_pool.v[layer.layer_id]
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, fb.out_cache_loc)
        return deterministic_attention(
            q,
            k_cache,
            v_cache,
            fb.req_to_token,
            self.req_rows,
            self.seq_lens,
            self.extend_lens,
            self.extend_starts,
            self.max_extend_len,
            layer.scaling,
        )
