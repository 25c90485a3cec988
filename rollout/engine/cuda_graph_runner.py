"""Decode forwards replayed from CUDA graphs, one graph per batch-size bucket, captured at start.

A decode step of a small model is hundreds of short kernels; launched one by one from Python
they take longer than they run. A graph launches the whole forward at once. A batch is padded
up to the next captured size: padding rows store their K/V in slot 0 (which KVPool never hands
out) and attend to it alone, so they never touch a real request's KV.

Only the model forward is captured: logits and sampling run eagerly after it, on the real rows.
All graphs share one memory pool, captured largest first so the smaller ones fit in its blocks.

NOTE: graphs hold the addresses of the weights, the KV pool, req_to_token and the backend's
buffers. Anything that replaces those tensors (rather than writing into them) must capture again.
With LoRA adapters the same holds of the adapter slots and the LoRA batch buffers (models/
lora_layer.py): loading an adapter copies into its slot, and each step's rows are written into
the batch buffers, padded to the graph's size (LoraBatch.pad_to).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from rollout.forward import memory_regions
from rollout.forward.attention.base import AttentionBackend
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kv_pool import KVPool

if TYPE_CHECKING:
    from rollout.models.lora_layer import LoraBatch

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to and including
    max_batch_size. A batch pads to the next size, so padding stays under 16 rows."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += range(16, max_batch_size + 1, 16)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def padded_size(sizes: list[int], batch_size: int) -> int | None:
    """The smallest of `sizes` (ascending) that holds batch_size rows; None if none does."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


class GraphInputs:
    """The token inputs of a runner's graphs at fixed addresses: each graph reads the first
    rows of its size. Zeros are valid padding everywhere (token 0, position 0, KV slot 0)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.out_cache_loc = torch.zeros(rows, dtype=torch.int64, device=device)

    def fill(self, fb: ForwardBatch, rows: int) -> None:
        """fb's tokens in the first rows, for a graph of `rows` rows."""
        t = fb.input_ids.shape[0]
        self.input_ids[:t].copy_(fb.input_ids)
        self.positions[:t].copy_(fb.positions)
        self.out_cache_loc[:t].copy_(fb.out_cache_loc)
        # NOTE: rows t..rows may hold a previous batch's slots, now someone else's: pad with 0.
        self.out_cache_loc[t:rows].zero_()


def capture_forward(
    model: nn.Module, fb: ForwardBatch, stream: torch.cuda.Stream, pool
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of model's forward over fb (its backend prepared for the capture), and the
    output tensor each replay writes."""
    device = fb.input_ids.device
    # One eager run on the capture stream first: lazy initialisation (cuBLAS workspaces, kernel
    # loading and compiles for these shapes) is not allowed while capturing.
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        model(fb.input_ids, fb.positions, fb)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with memory_regions.cuda_graph(graph, pool, stream, device):
        out = model(fb.input_ids, fb.positions, fb)
    return graph, out


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_to_token: torch.Tensor,
        max_batch_size: int,
        device: torch.device,
        lora: LoraBatch | None = None,
    ) -> None:
        """Captures graphs for decode batches of up to max_batch_size rows (the KernelPlan's
        cuda_graph_max_bs); larger batches are not this runner's (can_replay says no). With
        `lora` (the model's layers have adapter slots), the graphs run the LoRA layers for
        every replay: the runner prepares each step's rows before replaying."""
        if not backend.supports_cuda_graph:
            raise ValueError(f"{type(backend).__name__} cannot run inside a CUDA graph")
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = device
        self.lora = lora
        self.pool = torch.cuda.graph_pool_handle()  # the extend graphs share it
        self.sizes = graph_batch_sizes(max_batch_size)
        n = self.sizes[-1]
        if lora is not None and lora.max_tokens < n:
            raise ValueError(
                f"the LoRA batch buffers hold {lora.max_tokens} rows, fewer than the largest "
                f"CUDA graph's batch ({n})"
            )
        # Captured base-only: a graph runs the LoRA layers for any later mix of adapters.
        self.no_adapters = torch.full((n,), -1, dtype=torch.int32)  # on the host, as a step's
        self.inputs = GraphInputs(n, device)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=device)
        self.ones = torch.ones(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bs, hidden] written by each replay
        self.capture()

    def _static_batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.inputs.input_ids[:bs],
            positions=self.inputs.positions[:bs],
            out_cache_loc=self.inputs.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.ones[:bs],
            extend_lens=self.ones[:bs],
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.sizes):
            fb = self._static_batch(bs)
            self.backend.prepare_graph(bs, None)
            if self.lora is not None:
                self.lora.prepare(self.no_adapters[:bs], active=True)
            self.graphs[bs], self.outputs[bs] = capture_forward(self.model, fb, stream, self.pool)
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d decode CUDA graphs (batch sizes %s..%s) in %.1f s",
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def can_replay(self, fb: ForwardBatch) -> bool:
        return fb.mode is ForwardMode.DECODE and fb.batch_size <= self.sizes[-1]

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs fb's decode forward from the graph of the next captured size. Returns the
        hidden states of fb's rows, [B, hidden]; valid until the next replay."""
        b = fb.batch_size
        bs = padded_size(self.sizes, b)
        assert bs is not None, f"batch of {b} exceeds the largest graph ({self.sizes[-1]})"
        self.inputs.fill(fb, bs)
        self.backend.prepare_graph(bs, fb)
        if self.lora is not None:  # the runner prepared fb's rows: pad them to the graph's
            self.lora.pad_to(bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:b]
