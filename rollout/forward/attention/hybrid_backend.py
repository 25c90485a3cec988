"""One backend for extend (prefill and chunks), another for decode, over the same KV pool; and
optionally decode batches above a size back on the extend backend.

Every backend reads and writes the KVPool layout as it is, so the steps of a run mix freely:
FlashInfer's prefill kernels for extend with the Triton decode kernel for small decode batches,
where it needs no host-side plan per step and was the faster of the two in CUDA graphs, and
FlashInfer's decode for large ones (benchmarks/RESULTS.md, "Which decode kernel at which batch
size"). Which backend takes which batches is the KernelPlan's (rollout/forward/kernel_plan.py).
"""

from __future__ import annotations

import torch

from rollout.forward.attention.base import Attention, AttentionBackend
from rollout.forward.forward_batch import ForwardBatch, ForwardMode


class HybridAttentionBackend(AttentionBackend):
    def __init__(
        self, extend: AttentionBackend, decode: AttentionBackend, decode_max_batch: int | None = None
    ) -> None:
        """decode runs decode batches of up to decode_max_batch rows (None: all of them);
        extend runs the larger ones. A graph's batch is its padded size, here and in capture."""
        if decode_max_batch is not None and decode_max_batch < 1:
            raise ValueError(f"decode_max_batch must be >= 1 or None, got {decode_max_batch}")
        self.extend = extend
        self.decode = decode
        self.decode_max_batch = decode_max_batch
        self.supports_cuda_graph = decode.supports_cuda_graph and (
            decode_max_batch is None or extend.supports_cuda_graph
        )
        self.supports_extend_graph = extend.supports_extend_graph

    def _decode_for(self, batch_size: int) -> AttentionBackend:
        small = self.decode_max_batch is None or batch_size <= self.decode_max_batch
        return self.decode if small else self.extend

    def _for(self, fb: ForwardBatch) -> AttentionBackend:
        return self._decode_for(fb.batch_size) if fb.mode is ForwardMode.DECODE else self.extend

    def prepare(self, fb: ForwardBatch) -> None:
        self._for(fb).prepare(fb)

    def prepare_graph(self, padded_batch_size: int, fb: ForwardBatch | None) -> None:
        self._decode_for(padded_batch_size).prepare_graph(padded_batch_size, fb)

    def prepare_extend_graph(self, tokens: int, requests: int, fb: ForwardBatch | None) -> None:
        self.extend.prepare_extend_graph(tokens, requests, fb)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        return self._for(fb).forward(q, k, v, layer, fb, kv_stored)
