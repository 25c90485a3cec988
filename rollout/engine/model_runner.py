"""ModelRunner: turns a ScheduleBatch into tensors, runs the model, samples, computes logprobs.

It owns the model, the KV pool and the req->token table; it decides nothing about which
requests run (that is the scheduler's job).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from rollout.config import EngineOptions
from rollout.engine import memory_regions
from rollout.engine.attention import (
    AttentionShape,
    create_attention_backend,
    resolve_attention_backend,
)
from rollout.engine.cuda_graph_runner import CudaGraphRunner
from rollout.engine.forward_batch import ForwardBatch
from rollout.engine.kv_pool import KVPool, ReqToTokenPool
from rollout.engine.req import ScheduleBatch
from rollout.engine.sampler import SamplingBatch, sample
from rollout.models.layers import use_fused_kernels
from rollout.models.loader import load_model, resolve_dtype

logger = logging.getLogger(__name__)

CPU_DEFAULT_TOKENS = 4096
KERNEL_SAMPLING_MIN_ROWS = 32


@dataclass
class ReqStepOutput:
    """What one request got from one step. Logprob entries are (logprob, token_id)."""

    next_token: int | None = None
    token_logprob: tuple[float, int] | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    token_ids_logprobs: list[tuple[float, int]] | None = None
    hidden_state: list[float] | None = None
    embedding: list[float] | None = None  # embed requests: pooled output of the last token
    # Prompt positions computed this step: (logprob, id), top-k and requested-id logprobs.
    input_token_logprobs: list[tuple[float | None, int]] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class ModelRunner:
    def __init__(
        self, options: EngineOptions, hf_config, context_length: int, eos_token_ids: list[int]
    ) -> None:
        mopts = options.model
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(mopts.device or default_device())
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(mopts.dtype, hf_config)
        # Weights and KV live in tagged regions so that memory release can give them back (the
        # CPU copy of the weights, when asked for, is weight_sync.memory's pinned buffer).
        with memory_regions.region("weights", self.device):
            self.model = load_model(mopts.model_path, hf_config, self.dtype, self.device, mopts.load_format)
        self.hf_config = hf_config
        self.vocab_size = hf_config.vocab_size

        text_cfg = hf_config
        num_kv_heads = getattr(text_cfg, "num_key_value_heads", None) or text_cfg.num_attention_heads
        head_dim = getattr(text_cfg, "head_dim", None) or (
            text_cfg.hidden_size // text_cfg.num_attention_heads
        )
        num_layers = text_cfg.num_hidden_layers
        self.num_slots = self._kv_slots(options, num_layers, num_kv_heads, head_dim)
        with memory_regions.region("kv_cache", self.device):
            self.kv_pool = KVPool(num_layers, self.num_slots, num_kv_heads, head_dim, self.dtype, self.device)
        self.context_length = min(context_length, self.num_slots)
        # One spare row: a request leaving and one arriving may overlap within a step.
        self.req_to_token = ReqToTokenPool(
            options.scheduler.max_running_requests + 1, self.context_length + 1, self.device
        )
        self._init_attention(options, num_kv_heads, head_dim)

    def _init_attention(self, options: EngineOptions, num_kv_heads: int, head_dim: int) -> None:
        mopts = options.model
        self.attention_backend = resolve_attention_backend(
            mopts.attention_backend, self.device, self.dtype
        )
        shape = AttentionShape(
            num_heads=self.hf_config.num_attention_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
            dtype=self.dtype,
            device=self.device,
            max_batch_size=self.req_to_token.max_reqs,
            max_context_len=self.context_length,
        )
        self.attn_backend = create_attention_backend(self.attention_backend, shape)
        # The GPU backends come with the Triton kernels for norms, rotary, SiLU-and-mul and
        # sampling; attention_backend="torch" stays all torch: it is the reference path.
        self.fused_kernels = self.attention_backend != "torch"
        use_fused_kernels(self.model, self.fused_kernels)
        self.graph_runner: CudaGraphRunner | None = None
        graphs = not mopts.disable_cuda_graph and self.attn_backend.supports_cuda_graph
        if self.device.type == "cuda" and graphs:
            max_bs = min(mopts.cuda_graph_max_bs, options.scheduler.max_running_requests)
            self.graph_runner = CudaGraphRunner(
                self.model, self.attn_backend, self.kv_pool, self.req_to_token.table, max_bs, self.device
            )
        logger.info(
            "attention backend %s, decode CUDA graphs %s",
            self.attention_backend,
            self.graph_runner.sizes if self.graph_runner else "off",
        )

    def _kv_slots(self, options: EngineOptions, layers: int, kv_heads: int, head_dim: int) -> int:
        if options.cache.max_total_tokens is not None:
            return options.cache.max_total_tokens
        if self.device.type != "cuda":
            return CPU_DEFAULT_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - total * (1.0 - options.cache.mem_fraction)
        per_token = KVPool.bytes_per_token(layers, kv_heads, head_dim, self.dtype)
        slots = int(budget // per_token)
        if slots < 16:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (free {free / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB at mem_fraction={options.cache.mem_fraction})"
            )
        return slots

    @torch.inference_mode()
    def forward(self, batch: ScheduleBatch) -> list[ReqStepOutput]:
        """Runs one step. Before: each req's KV covers [0, kv_len) and `batch.out_cache_loc` holds
        slots for its next extend_lens[i] tokens, already written to its req->token row."""
        fb, rows, owners = self._build(batch)
        hidden = self._run_model(fb)
        outs = [ReqStepOutput() for _ in batch.reqs]
        for req, out in zip(batch.reqs, outs):
            if req.wants_prompt_logprobs() and req.kv_len == 0 and req.req.logprob_start_len == 0:
                # The first token has no logprob: nothing precedes it.
                out.input_token_logprobs.append((None, req.ids[0]))
                out.input_top_logprobs.append(None)
                out.input_token_ids_logprobs.append(None)
        if not rows:
            return outs
        # A decode samples every row in order: no gather (its index copy would wait for the GPU).
        every_row = len(rows) == hidden.shape[0] and rows[-1] == len(rows) - 1
        selected = hidden if every_row else hidden[self._to_device(rows)]
        if self._pool(batch, owners, selected, outs):
            return outs
        logits = self.model.compute_logits(selected)  # [R, V] float32
        need_logprobs = any(r.req.return_logprob for r in batch.reqs)
        logprobs = torch.log_softmax(logits, dim=-1) if need_logprobs else None

        sample_idx = [k for k, (i, kind, _) in enumerate(owners) if kind == "sample"]
        sample_reqs = [batch.reqs[owners[k][0]] for k in sample_idx]
        if sample_idx:
            sampling = SamplingBatch.build(
                [r.req.params for r in sample_reqs],
                [r.req.seed for r in sample_reqs],
                [r.output_ids for r in sample_reqs],
                [r.prompt_ids for r in sample_reqs],
                self.eos_token_ids,
                logits.shape[-1],
                self.device,
            )
            every = len(sample_idx) == len(logits)
            rows_logits = logits if every else logits[self._to_device(sample_idx)]
            # One kernel program samples one row: it wins from a few dozen rows on (Qwen3-0.6B's
            # vocabulary, H100: 0.28 ms for 1 row, 0.41 ms for 256; the torch ops ~3.4 ms at 256).
            kernel = self.fused_kernels and len(sample_idx) >= KERNEL_SAMPLING_MIN_ROWS
            tokens = dict(zip(sample_idx, sample(rows_logits, sampling, kernel).tolist()))
        for k, (i, kind, target) in enumerate(owners):
            req, out = batch.reqs[i], outs[i]
            if kind == "pool":
                continue
            if kind == "sample":
                token = tokens[k]
                out.next_token = token
                if req.req.return_hidden_states:
                    out.hidden_state = selected[k].float().tolist()
                if logprobs is not None and req.req.return_logprob:
                    out.token_logprob = (logprobs[k, token].item(), token)
                    out.top_logprobs = self._top(logprobs[k], req.req.top_logprobs_num)
                    out.token_ids_logprobs = self._ids(logprobs[k], req.req.token_ids_logprob)
            else:  # a prompt position: logits at target-1 score prompt token `target`
                assert logprobs is not None
                token = req.ids[target]
                out.input_token_logprobs.append((logprobs[k, token].item(), token))
                out.input_top_logprobs.append(self._top(logprobs[k], req.req.top_logprobs_num))
                out.input_token_ids_logprobs.append(self._ids(logprobs[k], req.req.token_ids_logprob))
        return outs

    def _pool(
        self, batch: ScheduleBatch, owners: list[tuple[int, str, int]], selected: torch.Tensor,
        outs: list[ReqStepOutput],
    ) -> bool:  # fmt: skip
        """Fills the embeddings of the rows that pool (an embed request's last token) and says
        whether that was every row (then no logits are needed: a classifier has no LM head).
        selected: [R, hidden] final-norm hidden states of the rows in `owners`."""
        pool_idx = [k for k, (_, kind, _) in enumerate(owners) if kind == "pool"]
        if pool_idx:
            pooled = selected[self._to_device(pool_idx)]  # [P, hidden]
            if hasattr(self.model, "compute_scores"):
                pooled = self.model.compute_scores(pooled)  # [P, num_labels]
            pooled = pooled.float()
            for row, k in zip(pooled, pool_idx):
                req = batch.reqs[owners[k][0]]
                row = torch.nn.functional.normalize(row, dim=-1) if req.req.normalize else row
                outs[owners[k][0]].embedding = row.tolist()
        return len(pool_idx) == len(owners)

    def _build(self, batch: ScheduleBatch) -> tuple[ForwardBatch, list[int], list[tuple[int, str, int]]]:
        """Tensors for the forward, plus which hidden rows need logits and why:
        owners[k] = (req index, "sample" | "prompt", target position)."""
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        owners: list[tuple[int, str, int]] = []
        for i, (req, ext) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start, ids = req.kv_len, req.ids
            base = len(input_ids)
            input_ids.extend(ids[start : start + ext])
            positions.extend(range(start, start + ext))
            if req.wants_prompt_logprobs():
                first = max(req.req.logprob_start_len, 1)
                # Position p's logits score token p + 1, for prompt tokens first .. P-1.
                for p in range(max(start, first - 1), min(start + ext, len(req.prompt_ids) - 1)):
                    rows.append(base + p - start)
                    owners.append((i, "prompt", p + 1))
            if batch.samples(i):
                rows.append(base + ext - 1)
                owners.append((i, "pool" if req.req.embed else "sample", start + ext))
        dev = self.device
        seq_lens = [r.kv_len + e for r, e in zip(batch.reqs, batch.extend_lens)]
        fb = ForwardBatch(
            mode=batch.mode,
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            out_cache_loc=batch.out_cache_loc.to(dev, non_blocking=True),
            req_pool_indices=self._to_device([r.row for r in batch.reqs]),
            seq_lens=self._to_device(seq_lens),
            extend_lens=self._to_device(batch.extend_lens),
            req_to_token=self.req_to_token.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(batch.extend_lens),
        )
        return fb, rows, owners

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """int64 tensor of `values` on the device. Non-blocking: a blocking copy from pageable
        memory would first wait for everything queued on the GPU."""
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states of fb's tokens, [T, hidden]: from a CUDA graph where one fits."""
        if self.graph_runner is not None and self.graph_runner.can_replay(fb):
            return self.graph_runner.replay(fb)
        self.attn_backend.prepare(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    @staticmethod
    def _top(logprobs: torch.Tensor, k: int) -> list[tuple[float, int]] | None:
        if k <= 0:
            return None
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]))
        return list(zip(values.tolist(), ids.tolist()))

    @staticmethod
    def _ids(logprobs: torch.Tensor, token_ids: list[int] | None) -> list[tuple[float, int]] | None:
        if not token_ids:
            return None
        return list(zip(logprobs[token_ids].tolist(), token_ids))
