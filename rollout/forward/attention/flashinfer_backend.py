"""Attention through FlashInfer's paged-KV kernels, over the KVPool layout as it is.

KVPool keeps one [num_slots + 1, kv_heads, head_dim] tensor per layer for K and one for V, a
token per slot; FlashInfer sees that as pages of one token (NHD layout, page_size 1), and a
request's page list is its row of req_to_token. (With decode_attention_backend="auto", small
decode batches run on the Triton kernel instead: see rollout/forward/kernel_plan.py.) An 8-bit
KV pool is read as it is (kv_data_type), with queries in the model's dtype. Decode here uses the
tensor-core decode kernels: they take any GQA group size (Qwen2.5-7B has 7 query heads per KV
head, which the CUDA-core decode kernels reject) and are compiled from the same FA2 module as
extend, so a machine JIT-compiles one module per dtype pair and head size instead of three.
"""

from __future__ import annotations

import builtins
import itertools

import torch

from rollout.forward.attention.base import Attention, AttentionBackend, AttentionShape
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout_kernels.kv_store import store_kv

# The split-KV scratch space every wrapper shares: FlashInfer recommends 128 MiB, what eager plans
# fit in; graphs of many rows need more (workspace_bytes).
MIN_WORKSPACE_BYTES = 128 << 20
_PAGE_SIZE = 1
_KERNELS = "fa2"


def tensor_aware_max(*args, **kwargs):
    """builtins.max, except that a lone tensor argument is reduced by one tensor op. The
    builtin walks a tensor as B Python scalars, one comparison op each, and FlashInfer's plan()
    takes `max(kv_lens)` of a host tensor every decode step. At a large batch that walk was
    most of a decode plan's host time (benchmarks/RESULTS.md, seventh and eighth sessions),
    time the scheduler needs to stay ahead of the device."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
        return args[0].max()
    return builtins.max(*args, **kwargs)


def speed_up_plans(flashinfer) -> None:
    """Makes FlashInfer's plan() modules find tensor_aware_max under the name `max`: a
    module-level name shadows the builtin for that module's code and nothing else."""
    for name in ("decode", "prefill"):
        module = getattr(flashinfer, name, None)
        if module is not None and "max" not in vars(module):
            module.max = tensor_aware_max


def _cta_tile_q(packed_qo_len: int, head_dim: int) -> int:
    """The query rows of a thread block that FlashInfer's FA2 prefill plan picks for queries of
    up to packed_qo_len rows (query tokens times the GQA group) on sm80 and newer."""
    if head_dim >= 512:
        return 16 if packed_qo_len <= 32 else 32
    if packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if packed_qo_len > 16 else 16


def graph_split_bytes(shape: AttentionShape, rows: int, requests: int, num_sms: int) -> int:
    """The float workspace a prefill-kernel plan made for a CUDA graph of `rows` query tokens
    over `requests` requests reserves for split-KV partial outputs and their softmax sums (the
    tensor-core decode kernels plan this way too, a query token a request). A graph's plan sizes
    them for any lengths the graph may replay: a piece for every tile of query rows the
    requests could make, and at least as many as two thread blocks an SM would take."""
    group = shape.num_heads // shape.num_kv_heads
    tile = _cta_tile_q((rows - requests + 1) * group, shape.head_dim)
    pieces = max(2 * num_sms // shape.num_kv_heads, -(-rows * group // tile) + requests - 1)
    return shape.num_heads * pieces * tile * (shape.head_dim + 1) * 4  # float32


def workspace_bytes(shape: AttentionShape, num_sms: int) -> int:
    """The float workspace for every plan the backend makes, with 1 MiB for the allocator's
    alignment, and at least FlashInfer's recommended 128 MiB. An eager plan splits keys only
    into as many pieces as two thread blocks an SM would take, of at most the largest query
    tile; a graph's plan as its decode graphs (a request a row) or extend graphs (a padding
    request after the real ones) need."""
    kv_heads, head_dim = shape.num_kv_heads, shape.head_dim
    most_tile = _cta_tile_q(1 << 30, head_dim)
    need = shape.num_heads * (2 * num_sms // kv_heads) * most_tile * (head_dim + 1) * 4
    for rows in range(1, shape.graph_batch_size + 1):
        need = max(need, graph_split_bytes(shape, rows, rows, num_sms))
    for tokens in range(1, shape.max_graph_extend_tokens + 1):
        requests = min(shape.max_graph_extend_requests, tokens) + 1
        need = max(need, graph_split_bytes(shape, tokens, requests, num_sms))
    return max(MIN_WORKSPACE_BYTES, need + (1 << 20))


def host_indptr(lengths: list[int]) -> torch.Tensor:
    """[B + 1] int32 CPU offsets of B back-to-back segments of `lengths`."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def kv_indices(fb: ForwardBatch, total: int) -> torch.Tensor:
    """[total] int32 KV slots of fb's requests, each request's seq_len slots in order, without
    a host sync (total = sum(fb.seq_lens_cpu) is known on the host)."""
    seq_lens = fb.seq_lens  # [B] int64
    starts = torch.cumsum(seq_lens, 0) - seq_lens  # [B]
    rows = torch.repeat_interleave(fb.req_pool_indices, seq_lens, output_size=total)  # [N]
    first = torch.repeat_interleave(starts, seq_lens, output_size=total)  # [N]
    cols = torch.arange(total, device=seq_lens.device) - first
    return fb.req_to_token[rows, cols].to(torch.int32)


class FlashInferAttentionBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_extend_graph = True

    def __init__(self, shape: AttentionShape) -> None:
        try:
            import flashinfer
        except ImportError as e:
            raise ImportError(
                "attention_backend='flashinfer' needs the flashinfer-python package; "
                "install it or use attention_backend='torch'"
            ) from e
        self._flashinfer = flashinfer
        speed_up_plans(flashinfer)
        self.shape = shape
        cuda = shape.device.type == "cuda"  # (tests plan on the CPU with a stand-in module)
        sms = torch.cuda.get_device_properties(shape.device).multi_processor_count if cuda else 1
        self.workspace = torch.zeros(
            workspace_bytes(shape, sms), dtype=torch.uint8, device=shape.device
        )
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True, backend=_KERNELS
        )
        self.extend_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=_KERNELS
        )
        self._ones = torch.ones(shape.max_batch_size + 1, dtype=torch.int32)  # last page lengths
        self._graph_wrappers: dict[int, object] = {}
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._decode = self.decode_wrapper  # the wrapper planned for the next decode
        self._extend = self.extend_wrapper  # ... and for the next extend
        self._extend_graph_wrappers: dict[tuple[int, int], object] = {}
        self._extend_graph_buffers: tuple[torch.Tensor, ...] | None = None
        self._extend_graph_max = (0, 0)  # (tokens, requests) the buffers were sized for
        self._plan_copied: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> after its last plan

    # ---- per-forward plans ----------------------------------------------------------------
    def _plan(self, wrapper, *args, **kwargs) -> None:
        """wrapper.plan(...), once the device has taken in that wrapper's previous plan.

        FlashInfer stages a plan in one pinned host buffer per wrapper and copies it to the
        device asynchronously. With a step in flight (overlap), re-planning a wrapper before that
        copy ran would rewrite the plan of a step still queued. The wait is for the copy only,
        queued right after the step before the one in flight, which the scheduler has already
        waited for: in practice it returns at once."""
        copied = self._plan_copied.get(id(wrapper))
        if copied is not None:
            copied.synchronize()
        wrapper.plan(*args, **kwargs)
        if self.shape.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._plan_copied[id(wrapper)] = event

    def _plan_args(self) -> dict:
        s = self.shape
        return {
            "num_qo_heads": s.num_heads,
            "num_kv_heads": s.num_kv_heads,
            "page_size": _PAGE_SIZE,
            "sm_scale": s.scaling,
            "q_data_type": s.dtype,
            "kv_data_type": s.cache_dtype,
        }

    def prepare(self, fb: ForwardBatch) -> None:
        indptr = host_indptr(fb.seq_lens_cpu)
        indices = kv_indices(fb, int(indptr[-1]))
        last_page_len = self._ones[: fb.batch_size]
        head_dim = self.shape.head_dim
        if fb.mode is ForwardMode.DECODE:
            self._plan(
                self.decode_wrapper,
                indptr, indices, last_page_len, head_dim=head_dim, **self._plan_args(),
            )  # fmt: skip
            self._decode = self.decode_wrapper
        else:
            # Causal masks in FlashInfer align the queries with the last KV positions: exactly a
            # chunk of new tokens after its cached prefix.
            self._plan(
                self.extend_wrapper,
                host_indptr(fb.extend_lens_cpu),
                indptr,
                indices,
                last_page_len,
                head_dim_qk=head_dim,
                causal=True,
                **self._plan_args(),
            )
            self._extend = self.extend_wrapper

    def prepare_graph(self, padded_batch_size: int, fb: ForwardBatch | None) -> None:
        wrapper = self._graph_wrapper(padded_batch_size)
        real = 0 if fb is None else fb.batch_size
        pad = padded_batch_size - real
        lengths = ([] if fb is None else fb.seq_lens_cpu) + [1] * pad
        indptr = host_indptr(lengths)
        self._plan(
            wrapper,
            indptr,
            self._padded_kv_indices(fb, int(indptr[real]), pad),
            self._ones[:padded_batch_size],
            head_dim=self.shape.head_dim,
            **self._plan_args(),
        )
        self._decode = wrapper

    def _padded_kv_indices(self, fb: ForwardBatch | None, total: int, pad: int) -> torch.Tensor:
        """fb's KV slots (`total` of them; fb None: none), then `pad` copies of slot 0."""
        pad_slots = torch.zeros(pad, dtype=torch.int32, device=self.shape.device)
        return pad_slots if fb is None else torch.cat([kv_indices(fb, total), pad_slots])

    def _graph_wrapper(self, batch_size: int):
        """The decode wrapper whose plan lives at fixed addresses, one per captured batch size;
        all share one set of buffers (only one is planned and replayed at a time)."""
        if batch_size > self.shape.graph_batch_size:
            raise ValueError(
                f"graph batch size {batch_size} exceeds the largest graph batch "
                f"{self.shape.graph_batch_size}"
            )
        if self._graph_buffers is None:
            dev, n = self.shape.device, self.shape.graph_batch_size
            self._graph_buffers = (
                torch.zeros(n + 1, dtype=torch.int32, device=dev),  # indptr
                # Every request may read a whole context (prefix slots are shared between them).
                torch.zeros(n * self.shape.max_context_len, dtype=torch.int32, device=dev),
                torch.ones(n, dtype=torch.int32, device=dev),  # last page lengths
            )
        if batch_size not in self._graph_wrappers:
            indptr, indices, last = self._graph_buffers
            self._graph_wrappers[batch_size] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=True,
                paged_kv_indptr_buffer=indptr[: batch_size + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:batch_size],
                backend=_KERNELS,
            )
        return self._graph_wrappers[batch_size]

    def prepare_extend_graph(self, tokens: int, requests: int, fb: ForwardBatch | None) -> None:
        wrapper = self._extend_graph_wrapper(tokens, requests)
        real = 0 if fb is None else fb.batch_size
        used = 0 if fb is None else sum(fb.extend_lens_cpu)
        if real > requests or used > tokens:
            raise ValueError(
                f"an extend of {real} requests and {used} tokens exceeds the graph's "
                f"{requests} requests and {tokens} tokens"
            )
        # fb's requests, empty slots up to `requests`, then one request of the padding tokens
        # over as many copies of slot 0 (causal, each attends to slot 0 only).
        pad, empty = tokens - used, [0] * (requests - real)
        seq_lens = ([] if fb is None else fb.seq_lens_cpu) + empty + [pad]
        extend_lens = ([] if fb is None else fb.extend_lens_cpu) + empty + [pad]
        indptr = host_indptr(seq_lens)
        self._plan(
            wrapper,
            host_indptr(extend_lens),
            indptr,
            self._padded_kv_indices(fb, int(indptr[real]), pad),
            self._ones[: requests + 1],
            head_dim_qk=self.shape.head_dim,
            causal=True,
            **self._plan_args(),
        )
        self._extend = wrapper

    def _extend_graph_wrapper(self, tokens: int, requests: int):
        """The prefill wrapper whose plan lives at fixed addresses, one per captured (tokens,
        requests); all share one set of buffers (only one is planned and replayed at a time).
        FlashInfer fixes a graph wrapper's request count and its most tokens at its first
        plan, the capture's."""
        if requests + 1 > self._ones.shape[0]:
            raise ValueError(
                f"an extend graph of {requests} requests exceeds max_batch_size "
                f"{self.shape.max_batch_size}"
            )
        key = (tokens, requests)
        if key not in self._extend_graph_wrappers:
            n = requests + 1  # and the padding request
            if self._extend_graph_buffers is None:
                dev = self.shape.device
                self._extend_graph_buffers = (
                    torch.zeros(n + 1, dtype=torch.int32, device=dev),  # qo indptr
                    torch.zeros(n + 1, dtype=torch.int32, device=dev),  # kv indptr
                    # Each request's whole context (prefixes are shared), and the padding's.
                    torch.zeros(
                        requests * self.shape.max_context_len + tokens, dtype=torch.int32, device=dev
                    ),
                    torch.ones(n, dtype=torch.int32, device=dev),  # last page lengths
                )
                self._extend_graph_max = key
            most_tokens, most_requests = self._extend_graph_max
            if tokens > most_tokens or requests > most_requests:
                raise ValueError("extend graphs must be made largest first: they share buffers")
            qo, kv, indices, last = self._extend_graph_buffers
            self._extend_graph_wrappers[key] = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=qo[: n + 1],
                paged_kv_indptr_buf=kv[: n + 1],
                paged_kv_indices_buf=indices,
                paged_kv_last_page_len_buf=last[:n],
                backend=_KERNELS,
            )
        return self._extend_graph_wrappers[key]

    # ---- per-layer ---------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: Attention, fb: ForwardBatch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if layer.scaling != self.shape.scaling:
            raise ValueError(
                f"layer {layer.layer_id} scales attention by {layer.scaling}, but the plan was made "
                f"for {self.shape.scaling}"
            )
        k_cache, v_cache = fb.kv_pool.k[layer.layer_id], fb.kv_pool.v[layer.layer_id]
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, fb.out_cache_loc)  # one launch for K and V
        # [num_slots + 1, page_size 1, kv_heads, head_dim]
        cache = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))
        if fb.mode is ForwardMode.DECODE:
            return self._decode.run(q, cache)
        return self._extend.run(q, cache)
