"""ModelRunner: turns a ScheduleBatch into tensors, runs the model, samples, computes logprobs.

It owns the model, the KV pool and the req->token table; it decides nothing about which
requests run (that is the scheduler's job).
"""

from __future__ import annotations

import logging

import torch

from rollout.config import EngineOptions
from rollout.engine.cuda_graph_runner import CudaGraphRunner
from rollout.engine.launched_step import LaunchedStep, LogitRow, ReqStepOutput
from rollout.engine.req import Req, ScheduleBatch
from rollout.engine.sampler import SamplingBatch, sample
from rollout.forward import memory_regions
from rollout.forward.attention import (
    AttentionShape,
    create_attention_backend,
    resolve_attention_backend,
    resolve_decode_backend,
)
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kv_pool import KVPool, ReqToTokenPool, check_kv_dtype_runs, kv_cache_dtype
from rollout.models.layers import use_fused_kernels
from rollout.models.loader import load_model, resolve_dtype

logger = logging.getLogger(__name__)

CPU_DEFAULT_TOKENS = 4096
KERNEL_SAMPLING_MIN_ROWS = 32


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
        self.kv_dtype = kv_cache_dtype(options.cache.kv_cache_dtype, self.dtype)
        check_kv_dtype_runs(self.kv_dtype, self.device)
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
            self.kv_pool = KVPool(num_layers, self.num_slots, num_kv_heads, head_dim, self.kv_dtype, self.device)
        self.context_length = min(context_length, self.num_slots)
        # One spare row: a request leaving and one arriving may overlap within a step.
        self.req_to_token = ReqToTokenPool(
            options.scheduler.max_running_requests + 1, self.context_length + 1, self.device
        )
        # The last token sampled for each req->token row: the input of the row's next decode,
        # which may be launched before that token reaches the host.
        self.last_token = torch.zeros(
            self.req_to_token.max_reqs, dtype=torch.int64, device=self.device
        )
        self._init_attention(options, num_kv_heads, head_dim)

    def _init_attention(self, options: EngineOptions, num_kv_heads: int, head_dim: int) -> None:
        mopts = options.model
        self.attention_backend = resolve_attention_backend(
            mopts.attention_backend, self.device, self.dtype
        )
        self.decode_attention = resolve_decode_backend(
            mopts.decode_attention_backend, self.attention_backend, self.device, self.dtype,
            mopts.triton_decode_max_batch,
        )
        shape = AttentionShape(
            num_heads=self.hf_config.num_attention_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            device=self.device,
            max_batch_size=self.req_to_token.max_reqs,
            max_context_len=self.context_length,
        )
        self.attn_backend = create_attention_backend(
            self.attention_backend, shape, self.decode_attention
        )
        # The GPU backends come with the Triton kernels for norms, rotary, SiLU-and-mul and
        # sampling; attention_backend="torch" stays all torch: it is the reference path.
        self.fused_kernels = self.attention_backend != "torch"
        use_fused_kernels(self.model, self.fused_kernels, mopts.skinny_gemm_max_rows)
        self.graph_runner: CudaGraphRunner | None = None
        graphs = not mopts.disable_cuda_graph and self.attn_backend.supports_cuda_graph
        if self.device.type == "cuda" and graphs:
            max_bs = min(mopts.cuda_graph_max_bs, options.scheduler.max_running_requests)
            self.graph_runner = CudaGraphRunner(
                self.model, self.attn_backend, self.kv_pool, self.req_to_token.table, max_bs, self.device
            )
        logger.info(
            "attention backend %s (decode %s), decode CUDA graphs %s",
            self.attention_backend,
            self.decode_attention,
            self.graph_runner.sizes if self.graph_runner else "off",
        )

    def _kv_slots(self, options: EngineOptions, layers: int, kv_heads: int, head_dim: int) -> int:
        if options.cache.max_total_tokens is not None:
            return options.cache.max_total_tokens
        if self.device.type != "cuda":
            return CPU_DEFAULT_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - total * (1.0 - options.cache.mem_fraction)
        per_token = KVPool.bytes_per_token(layers, kv_heads, head_dim, self.kv_dtype)
        slots = int(budget // per_token)
        if slots < 16:
            raise RuntimeError(
                f"no GPU memory left for the KV cache (free {free / 2**30:.1f} GiB of "
                f"{total / 2**30:.1f} GiB at mem_fraction={options.cache.mem_fraction})"
            )
        return slots

    @torch.inference_mode()
    def launch(self, batch: ScheduleBatch) -> LaunchedStep:
        """Queues one step on the device and returns it; nothing here waits for the device.
        Before: request i's KV covers [0, batch.starts[i]) and `batch.out_cache_loc` holds slots
        for its next extend_lens[i] tokens, already written to its req->token row. A decode reads
        each request's input token from `last_token`, so the previous step may still be running.
        Requests with sampling penalties must have all their sampled tokens in output_ids."""
        decode = batch.mode is ForwardMode.DECODE
        fb, hidden_rows, rows = self._build_decode(batch) if decode else self._build_extend(batch)
        hidden = self._run_model(fb)
        step = LaunchedStep(batch, rows, [ReqStepOutput() for _ in batch.reqs])
        if not decode:
            for req, start, out in zip(batch.reqs, batch.starts, step.outs):
                if req.wants_prompt_logprobs() and start == 0 and req.req.logprob_start_len == 0:
                    # The first token has no logprob: nothing precedes it.
                    out.input_token_logprobs.append((None, req.ids[0]))
                    out.input_top_logprobs.append(None)
                    out.input_token_ids_logprobs.append(None)
        if rows:
            # A decode samples every row in order: no gather, and the rows' req->token rows
            # are the batch's own.
            n = len(hidden_rows)
            every_row = n == hidden.shape[0] and hidden_rows[-1] == n - 1
            selected = hidden if every_row else hidden[self._to_device(hidden_rows)]
            table_rows = fb.req_pool_indices if decode else None
            self._queue_outputs(batch.reqs, rows, selected, step.tensors, table_rows)
        step.copy_to_host(self.device)
        return step

    def check_device(self) -> None:
        """Raises if the device can run no more work. A CUDA error such as a device-side assert
        breaks the context for good (every later call fails with it); an error that leaves the
        device working, such as running out of memory, was the failing step's own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def resolve(self, step: LaunchedStep) -> list[ReqStepOutput]:
        """Waits for a launched step; one output per request of its batch, in order."""
        return step.outputs()

    def _queue_outputs(
        self,
        reqs: list[Req],
        rows: list[LogitRow],
        selected: torch.Tensor,
        out: dict[str, torch.Tensor],
        table_rows: torch.Tensor | None = None,
    ) -> None:
        """Queues the device work of the rows' outputs, named as in LaunchedStep, into `out`.
        selected: [R, hidden] final-norm hidden states of `rows`; table_rows: [R] the rows'
        req->token rows on the device, when every row samples (else built here)."""
        pool = [k for k, row in enumerate(rows) if row.kind == "pool"]
        if pool:
            pooled = selected[self._to_device(pool)]
            out["pooled"] = self._pool([reqs[rows[k].req] for k in pool], pooled)
        if len(pool) == len(rows):
            return  # no logits needed: a classifier has no LM head
        logits = self.model.compute_logits(selected)  # [R, V] float32
        # Before sampling, which penalizes the logits in place.
        wants = [reqs[row.req].req.return_logprob and row.kind != "pool" for row in rows]
        lp_rows = [k for k, want in enumerate(wants) if want]
        logprobs = None
        if lp_rows:
            every = len(lp_rows) == len(rows)
            scored = logits if every else logits[self._to_device(lp_rows)]
            logprobs = torch.log_softmax(scored, dim=-1)
        sample_rows = [k for k, row in enumerate(rows) if row.kind == "sample"]
        tokens = None
        if sample_rows:
            tokens = self._sample(reqs, [rows[k] for k in sample_rows], sample_rows, logits, table_rows)
            out["tokens"] = tokens
            hidden = [k for k in sample_rows if reqs[rows[k].req].req.return_hidden_states]
            if hidden:
                out["hidden"] = selected[self._to_device(hidden)].float()
        if logprobs is not None:
            self._queue_logprobs(reqs, rows, lp_rows, sample_rows, logprobs, tokens, out)

    def _sample(
        self, reqs: list[Req], rows: list[LogitRow], at: list[int], logits: torch.Tensor,
        table_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Samples the `rows` (logits rows `at`) and stores each token as its request's
        `last_token` (at `table_rows`, the requests' req->token rows, when given on the
        device). Returns [S] int64 token ids on the device."""
        sreqs = [reqs[row.req] for row in rows]
        # Tokens generated before this one: those on the host plus any still on the device.
        steps = [row.target - len(r.prompt_ids) for row, r in zip(rows, sreqs)]
        for r, n in zip(sreqs, steps):
            assert not r.penalizes or len(r.output_ids) == n, (
                f"{r.rid}: penalties need its {n} output tokens on the host, {len(r.output_ids)} are"
            )
        sampling = SamplingBatch.build(
            [r.req.params for r in sreqs],
            [r.req.seed for r in sreqs],
            [r.output_ids for r in sreqs],
            [r.prompt_ids for r in sreqs],
            self.eos_token_ids,
            logits.shape[-1],
            self.device,
            steps=steps,
        )
        every = len(at) == len(logits)
        # With filters one kernel program samples one row: it wins from a few dozen rows on
        # (Qwen3-0.6B's vocabulary, H100: 0.28 ms for 1 row, 0.41 ms for 256; the torch ops
        # ~3.4 ms at 256). Without, the kernel draws each row in chunks: any number of rows.
        kernel = self.fused_kernels and (
            len(at) >= KERNEL_SAMPLING_MIN_ROWS or not sampling.filtered
        )
        tokens = sample(logits if every else logits[self._to_device(at)], sampling, kernel)
        if table_rows is None:
            table_rows = self._to_device([r.row for r in sreqs])
        self.last_token[table_rows] = tokens
        return tokens

    def _queue_logprobs(
        self, reqs: list[Req], rows: list[LogitRow], lp_rows: list[int], sample_rows: list[int],
        logprobs: torch.Tensor, tokens: torch.Tensor | None, out: dict[str, torch.Tensor],
    ) -> None:  # fmt: skip
        """logprobs: [L, V] of rows `lp_rows`; tokens: [S] sampled at `sample_rows`."""
        # Each row's logprob is of the prompt token it scores, or of the token just sampled.
        if lp_rows == sample_rows:
            assert tokens is not None
            targets = tokens
        else:
            prompt_ids = [rows[k].target if rows[k].kind == "prompt" else 0 for k in lp_rows]
            targets = self._to_device(prompt_ids)
            where = {k: j for j, k in enumerate(sample_rows)}
            sampled = [(j, where[k]) for j, k in enumerate(lp_rows) if rows[k].kind == "sample"]
            if sampled:
                assert tokens is not None
                dst, src = zip(*sampled)
                targets[self._to_device(list(dst))] = tokens[self._to_device(list(src))]
        out["chosen"] = logprobs.gather(1, targets[:, None]).squeeze(1)
        lp_reqs = [reqs[rows[k].req].req for k in lp_rows]
        top_k = min(max(r.top_logprobs_num for r in lp_reqs), logprobs.shape[-1])
        if top_k > 0:
            out["top_values"], out["top_ids"] = logprobs.topk(top_k, dim=-1)
        pairs = [(j, t) for j, r in enumerate(lp_reqs) for t in r.token_ids_logprob or ()]
        if pairs:
            at, ids = zip(*pairs)
            out["id_logprobs"] = logprobs[self._to_device(list(at)), self._to_device(list(ids))]

    def _pool(self, reqs: list[Req], pooled: torch.Tensor) -> torch.Tensor:
        """Embeddings of embed requests: pooled: [P, hidden] hidden states of their last tokens.
        Returns [P, D] float32: the hidden states, or a classifier's scores; normalized on
        request."""
        if hasattr(self.model, "compute_scores"):
            pooled = self.model.compute_scores(pooled)  # [P, num_labels]
        pooled = pooled.float()
        if not any(r.req.normalize for r in reqs):
            return pooled
        normalize = torch.nn.functional.normalize
        rows = [normalize(v, dim=-1) if r.req.normalize else v for v, r in zip(pooled, reqs)]
        return torch.stack(rows)

    def _build_decode(self, batch: ScheduleBatch) -> tuple[ForwardBatch, list[int], list[LogitRow]]:
        """Tensors for a decode forward, plus which hidden rows need outputs and why: one token
        per request, each sampled. The per-request ints go to the device in one copy (this runs
        every step, for every running request)."""
        starts = batch.starts
        seq_lens = [start + 1 for start in starts]
        host = torch.tensor(
            [[r.row for r in batch.reqs], starts, seq_lens, batch.extend_lens], dtype=torch.int64
        )
        req_pool_indices, positions, seq_lens_dev, extend_lens = host.to(self.device, non_blocking=True)
        fb = ForwardBatch(
            mode=batch.mode,
            # The input tokens were sampled on the device and may not be on the host yet.
            input_ids=self.last_token[req_pool_indices],
            positions=positions,
            out_cache_loc=batch.out_cache_loc.to(self.device, non_blocking=True),
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens_dev,
            extend_lens=extend_lens,
            req_to_token=self.req_to_token.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(batch.extend_lens),
        )
        rows = [LogitRow(i, "sample", n) for i, n in enumerate(seq_lens)]
        return fb, list(range(len(seq_lens))), rows

    def _build_extend(self, batch: ScheduleBatch) -> tuple[ForwardBatch, list[int], list[LogitRow]]:
        """Tensors for an extend forward (prefill, chunks), plus which hidden rows need outputs
        and why."""
        input_ids: list[int] = []
        positions: list[int] = []
        hidden_rows: list[int] = []
        rows: list[LogitRow] = []
        for i, (req, start, ext) in enumerate(zip(batch.reqs, batch.starts, batch.extend_lens)):
            base = len(positions)
            input_ids.extend(req.ids[start : start + ext])
            positions.extend(range(start, start + ext))
            if req.wants_prompt_logprobs():
                first = max(req.req.logprob_start_len, 1)
                # Position p's logits score token p + 1, for prompt tokens first .. P-1.
                for p in range(max(start, first - 1), min(start + ext, len(req.prompt_ids) - 1)):
                    hidden_rows.append(base + p - start)
                    rows.append(LogitRow(i, "prompt", req.ids[p + 1]))
            if batch.samples(i):
                hidden_rows.append(base + ext - 1)
                rows.append(LogitRow(i, "pool" if req.req.embed else "sample", start + ext))
        dev = self.device
        req_pool_indices = self._to_device([r.row for r in batch.reqs])
        seq_lens = [start + ext for start, ext in zip(batch.starts, batch.extend_lens)]
        fb = ForwardBatch(
            mode=batch.mode,
            input_ids=self._to_device(input_ids),
            positions=self._to_device(positions),
            out_cache_loc=batch.out_cache_loc.to(dev, non_blocking=True),
            req_pool_indices=req_pool_indices,
            seq_lens=self._to_device(seq_lens),
            extend_lens=self._to_device(batch.extend_lens),
            req_to_token=self.req_to_token.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(batch.extend_lens),
        )
        return fb, hidden_rows, rows

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
