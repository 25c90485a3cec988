"""One backend for extend (prefill and chunks), another for decode, over the same KV pool; and
optionally decode batches above a size back on the extend backend, or from a size on, on a
third backend for large batches (the Triton decode kernel with long pieces, or the unsplit
kernel: benchmarks/RESULTS.md, forty-first and forty-second sessions).

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
        self, extend: AttentionBackend, decode: AttentionBackend, decode_max_batch: int | None = None,
        large: AttentionBackend | None = None, large_min_batch: int = 0,
    ) -> None:  # fmt: skip
        """decode runs decode batches of up to decode_max_batch rows (None: all of them);
        `large`, if given, those of at least large_min_batch rows that decode does not take;
        extend runs the others. A graph's batch is its padded size, here and in capture."""
        if decode_max_batch is not None and decode_max_batch < 1:
            raise ValueError(f"decode_max_batch must be >= 1 or None, got {decode_max_batch}")
        if large is not None and large_min_batch < 1:
            raise ValueError(f"large_min_batch must be >= 1, got {large_min_batch}")
        self.extend = extend
        self.decode = decode
        self.decode_max_batch = decode_max_batch
        self.large = large
        self.large_min_batch = large_min_batch
        self.supports_cuda_graph = (
            decode.supports_cuda_graph
            and (decode_max_batch is None or extend.supports_cuda_graph)
            and (large is None or large.supports_cuda_graph)
        )
        self.supports_extend_graph = extend.supports_extend_graph

    def _decode_for(self, batch_size: int) -> AttentionBackend:
        if self.decode_max_batch is not None and batch_size <= self.decode_max_batch:
            return self.decode
        if self.large is not None and batch_size >= self.large_min_batch:
            return self.large
        return self.decode if self.decode_max_batch is None else self.extend

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
