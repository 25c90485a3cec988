"""Short extend forwards replayed from CUDA graphs: one graph per token bucket, captured at start.

An extend of a few hundred tokens (a turn of a multi-turn rollout over its cached history, a
short prompt) runs the same hundreds of kernels as a decode step, and launched one by one from
Python they take several times longer than they run (benchmarks/RESULTS.md, twenty-fourth
session). A graph launches the whole forward at once.

A graph holds `tokens` new tokens over `requests` request slots. An extend of T tokens over B
requests replays the smallest bucket with tokens >= T (and requests >= B): its requests take the
first slots and tokens, the slots after them hold no tokens, and the T..tokens padding tokens
form one last request whose K/V go to slot 0 (which KVPool never hands out) and which attends
to slot 0 alone. Outputs of the padding are never read.

Only the model forward is captured, as for decode (engine/cuda_graph_runner.py, whose notes on
fixed addresses hold here too): logits, sampling and prompt logprobs run eagerly after it, on
the hidden rows the runner selects.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch
from torch import nn

from rollout.engine.cuda_graph_runner import GraphInputs, capture_forward
from rollout.forward.attention.base import AttentionBackend
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kv_pool import KVPool

logger = logging.getLogger(__name__)

# Most requests in one captured extend: a prefill step of more runs eagerly.
MAX_REQUESTS = 32


def graph_requests(max_requests: int) -> int:
    """The most requests an extend graph holds where a step may have up to max_requests."""
    return min(MAX_REQUESTS, max_requests)


def extend_token_buckets(max_tokens: int) -> list[int]:
    """The token counts to capture, ascending: powers of two from 8, and from 128 on their
    midpoints too (padding there stays under a third of a bucket), up to and including
    max_tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    buckets, size = [], 8
    while size < max_tokens:
        buckets.append(size)
        if size >= 128 and size + size // 2 < max_tokens:
            buckets.append(size + size // 2)
        size *= 2
    buckets.append(max_tokens)
    return buckets


def extend_bucket(buckets: list[int], max_requests: int, requests: int, tokens: int) -> int | None:
    """The smallest of `buckets` (ascending) that holds an extend of `tokens` new tokens over
    `requests` requests; None if none does. A bucket holds min(max_requests, its tokens)
    requests, and a request has at least one new token, so requests <= tokens always fit
    below max_requests."""
    if requests > max_requests:
        return None
    i = bisect.bisect_left(buckets, tokens)
    return buckets[i] if i < len(buckets) else None


class ExtendGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        kv_pool: KVPool,
        req_to_token: torch.Tensor,
        max_tokens: int,
        max_requests: int,
        device: torch.device,
        pool,
    ) -> None:
        """Captures graphs for extends of up to max_tokens new tokens over at most
        min(MAX_REQUESTS, max_requests) requests; others are not this runner's (can_replay
        says no). `pool`: the graph memory pool they share (the decode graphs')."""
        if not backend.supports_extend_graph:
            raise ValueError(f"{type(backend).__name__} cannot capture an extend")
        self.model = model
        self.backend = backend
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.device = device
        self.pool = pool
        self.buckets = extend_token_buckets(max_tokens)
        self.max_requests = graph_requests(max_requests)
        self.inputs = GraphInputs(self.buckets[-1], device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [tokens, hidden] written by each replay
        self.capture()

    def requests_of(self, tokens: int) -> int:
        """The request slots of the `tokens` bucket: a request has at least one new token."""
        return min(self.max_requests, tokens)

    def _static_batch(self, tokens: int) -> ForwardBatch:
        zeros = torch.zeros(1, dtype=torch.int64, device=self.device)
        return ForwardBatch(
            mode=ForwardMode.EXTEND,
            input_ids=self.inputs.input_ids[:tokens],
            positions=self.inputs.positions[:tokens],
            out_cache_loc=self.inputs.out_cache_loc[:tokens],
            # Not read inside the graph (the backend's plan, made outside it, places tokens).
            req_pool_indices=zeros,
            seq_lens=zeros + tokens,
            extend_lens=zeros + tokens,
            req_to_token=self.req_to_token,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            seq_lens_cpu=[tokens],
            extend_lens_cpu=[tokens],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        for tokens in reversed(self.buckets):  # largest first: the backend sizes its buffers
            fb = self._static_batch(tokens)
            self.backend.prepare_extend_graph(tokens, self.requests_of(tokens), None)
            self.graphs[tokens], self.outputs[tokens] = capture_forward(
                self.model, fb, stream, self.pool
            )
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d extend CUDA graphs (%s..%s tokens) in %.1f s",
            len(self.buckets), self.buckets[0], self.buckets[-1], time.perf_counter() - start,
        )  # fmt: skip

    def bucket(self, fb: ForwardBatch) -> int | None:
        """The captured token count fb replays at; None when none holds it."""
        if fb.mode is not ForwardMode.EXTEND:
            return None
        return extend_bucket(
            self.buckets, self.max_requests, fb.batch_size, sum(fb.extend_lens_cpu)
        )

    def can_replay(self, fb: ForwardBatch) -> bool:
        return self.bucket(fb) is not None

    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Runs fb's extend forward from the graph of its bucket. Returns the hidden states of
        fb's tokens, [T, hidden]; valid until the next replay of any graph of the pool."""
        tokens = self.bucket(fb)
        assert tokens is not None, "no extend graph holds this batch"
        self.inputs.fill(fb, tokens)
        self.backend.prepare_extend_graph(tokens, self.requests_of(tokens), fb)
        self.graphs[tokens].replay()
        return self.outputs[tokens][: fb.input_ids.shape[0]]
