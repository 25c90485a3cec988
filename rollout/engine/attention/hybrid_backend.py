"""One backend for extend (prefill and chunks), another for decode, over the same KV pool.

Every backend reads and writes the KVPool layout as it is, so the two halves of a forward mix
freely: FlashInfer's prefill kernels for extend with the Triton decode kernel, which on an H100
is as fast or faster in a CUDA graph (benchmarks/bench_attention.py) and needs no host-side plan
per step.
"""

from __future__ import annotations

import torch

from rollout.engine.attention.base import Attention, AttentionBackend
from rollout.engine.forward_batch import ForwardBatch, ForwardMode


class HybridAttentionBackend(AttentionBackend):
    def __init__(self, extend: AttentionBackend, decode: AttentionBackend) -> None:
        self.extend = extend
        self.decode = decode
        self.supports_cuda_graph = decode.supports_cuda_graph

    def _for(self, fb: ForwardBatch) -> AttentionBackend:
        return self.decode if fb.mode is ForwardMode.DECODE else self.extend

    def prepare(self, fb: ForwardBatch) -> None:
        self._for(fb).prepare(fb)

    def prepare_graph(self, padded_batch_size: int, fb: ForwardBatch | None) -> None:
        self.decode.prepare_graph(padded_batch_size, fb)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        return self._for(fb).forward(q, k, v, layer, fb, kv_stored)
