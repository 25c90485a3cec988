"""ModelRunner: turns a ScheduleBatch into tensors, runs the model, and queues the step's
outputs through its heads (sampling_head, logprob_head, pooling_head), without waiting.

It owns the model, the KV pool and the req->token table; it decides nothing about which
requests run (that is the scheduler's job).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from rollout.config import EngineOptions
from rollout.engine.cuda_graph_runner import CudaGraphRunner
from rollout.engine.device_ints import to_device
from rollout.engine.extend_graph_runner import ExtendGraphRunner, graph_requests
from rollout.engine.launched_step import LaunchedStep, LogitRow, ReqStepOutput
from rollout.engine.logprob_head import LogprobHead
from rollout.engine.lora_manager import LoraManager
from rollout.engine.pooling_head import PoolingHead
from rollout.engine.req import Req, ScheduleBatch
from rollout.engine.sampling_head import SamplingHead
from rollout.engine.tp_steps import StepSender
from rollout.forward import memory_regions
from rollout.forward.all_reduce_norm import AllReduceNorm
from rollout.forward.attention import AttentionShape, create_attention_backend
from rollout.forward.forward_batch import ForwardBatch, ForwardMode
from rollout.forward.kernel_plan import resolve_kernel_plan
from rollout.forward.kv_pool import KVPool, ReqToTokenPool, check_kv_dtype_runs, kv_cache_dtype
from rollout.forward.tensor_parallel import SINGLE, TPGroup
from rollout.models.layers import kernel, use_fused_kernels
from rollout.models.loader import load_model, resolve_dtype

CPU_DEFAULT_TOKENS = 4096


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class ModelRunner:
    def __init__(
        self,
        options: EngineOptions,
        hf_config,
        context_length: int,
        eos_token_ids: list[int],
        tp: TPGroup = SINGLE,
    ) -> None:
        """With `tp` of size > 1 the runner holds rank tp.rank's shard of the model and of each
        layer's KV heads; every rank must launch the same batches in the same order."""
        mopts = options.model
        self.tp = tp
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
            self.model = load_model(
                mopts.model_path, hf_config, self.dtype, self.device, mopts.load_format, tp=tp
            )
        self.hf_config = hf_config
        self.vocab_size = hf_config.vocab_size

        # This rank's heads: all of them at tp 1.
        num_kv_heads, head_dim = self.model.num_local_kv_heads, self.model.head_dim
        num_layers = hf_config.num_hidden_layers
        self.num_slots = self._kv_slots(options, num_layers, num_kv_heads, head_dim)
        # The options as this runner serves them: with max_running_requests resolved for the
        # pool (the scheduler, the warm-up and the kernel plan read them from here).
        limit = options.scheduler.running_limit(self.num_slots)
        self.options = options = dataclasses.replace(
            options, scheduler=dataclasses.replace(options.scheduler, max_running_requests=limit)
        )
        with memory_regions.region("kv_cache", self.device):
            self.kv_pool = KVPool(
                num_layers, self.num_slots, num_kv_heads, head_dim, self.kv_dtype, self.device
            )
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
        # The adapter slots: the layers add each row's adapter delta (enable_lora). Each
        # tensor-parallel rank holds its slices of them. Made before any CUDA graph is
        # captured: the graphs run the LoRA layers.
        self.lora: LoraManager | None = None
        if options.lora.enable_lora:
            use_kernels = self.device.type == "cuda"
            self.lora = LoraManager(self.model, options.lora, use_kernels)
        self._init_attention(options, num_kv_heads, head_dim)
        if self.lora is not None:  # launched as the plan launches them (programmatic or not)
            self.lora.slots.compile_kernels()
        # The heads turn a step's final hidden states into its outputs.
        self.sampling_head = SamplingHead(eos_token_ids, self.last_token, self.kernel_plan)
        self.logprob_head = LogprobHead(self.device, read_once=self.kernel_plan.logprob_kernel)
        self.pooling_head = PoolingHead(self.model)
        # Rank 0 of several: sends each batch to the other ranks before launching it.
        self.step_sender: StepSender | None = None

    def _init_attention(self, options: EngineOptions, num_kv_heads: int, head_dim: int) -> None:
        # Which kernels run is the plan's to say; the runner builds what it names.
        self.kernel_plan = plan = resolve_kernel_plan(options, self.device, self.dtype, head_dim)
        shape = AttentionShape(
            num_heads=self.model.num_local_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            device=self.device,
            max_batch_size=self.req_to_token.max_reqs,
            max_context_len=self.context_length,
            max_graph_batch_size=plan.cuda_graph_max_bs,  # 0 without graphs
            max_graph_extend_tokens=plan.extend_graph_max_tokens,
            max_graph_extend_requests=graph_requests(self.req_to_token.max_reqs - 1),
        )
        self.attn_backend = create_attention_backend(
            plan.attention_backend, shape, plan.decode_attention
        )
        use_fused_kernels(
            self.model, plan.fused_kernels, plan.skinny_gemm_max_rows, plan.skinny_gemm_min_weight,
            batch_invariant=plan.deterministic_inference,
        )
        if plan.fused_kernels or self.device.type == "cuda":  # LoRA's kernels run on any plan
            kernel("pdl").set_enabled(plan.programmatic_launch)
        if self.lora is not None:  # before any graph captures the layers
            self.lora.slots.run_beside(plan.lora_overlap_max_rows)
        # Every rank together, before the graphs capture the sums.
        hidden = self.hf_config.hidden_size
        all_reduce = AllReduceNorm.for_plan(plan, self.tp, hidden, self.dtype, self.device)
        if all_reduce is not None:
            self.model.model.defer_all_reduces(all_reduce)
        self.graph_runner: CudaGraphRunner | None = None
        self.extend_graphs: ExtendGraphRunner | None = None
        if plan.cuda_graphs:
            self.graph_runner = CudaGraphRunner(
                self.model, self.attn_backend, self.kv_pool, self.req_to_token.table,
                plan.cuda_graph_max_bs, self.device,
                None if self.lora is None else self.lora.slots.batch,
            )  # fmt: skip
        if plan.extend_graph_max_tokens:  # in the decode graphs' memory pool
            self.extend_graphs = ExtendGraphRunner(
                self.model, self.attn_backend, self.kv_pool, self.req_to_token.table,
                plan.extend_graph_max_tokens, self.req_to_token.max_reqs - 1, self.device,
                self.graph_runner.pool,
            )  # fmt: skip

    def _kv_slots(self, options: EngineOptions, layers: int, kv_heads: int, head_dim: int) -> int:
        if options.cache.max_total_tokens is not None:
            return options.cache.max_total_tokens
        if self.device.type != "cuda":
            return CPU_DEFAULT_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - total * (1.0 - options.cache.mem_fraction)
        per_token = KVPool.bytes_per_token(layers, kv_heads, head_dim, self.kv_dtype)
        slots = int(budget // per_token)
        if self.tp.size > 1:  # every rank holds the same slots: the fewest any rank has room for
            count = torch.tensor([slots], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self.tp.group)
            slots = int(count.item())
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
        if self.step_sender is not None:
            self.step_sender.send(batch)
        decode = batch.mode is ForwardMode.DECODE
        fb, hidden_rows, rows = self._build_decode(batch) if decode else self._build_extend(batch)
        if self.lora is not None:
            self.lora.prepare([req.req.lora_name for req in batch.reqs], fb.extend_lens_cpu)
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
            selected = hidden if every_row else hidden[to_device(hidden_rows, self.device)]
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
        req->token rows on the device, when every row samples (else built by the sampling head)."""
        pool = [k for k, row in enumerate(rows) if row.kind == "pool"]
        if pool:
            pooled = selected[to_device(pool, self.device)]
            out["pooled"] = self.pooling_head.pool([reqs[rows[k].req] for k in pool], pooled)
        if len(pool) == len(rows):
            return  # no logits needed: a classifier has no LM head
        logits = self.model.compute_logits(selected)  # [R, V] float32
        lp_rows = self.logprob_head.rows_of(reqs, rows)
        # Before sampling, which penalizes the logits in place.
        scored = self.logprob_head.score(reqs, rows, logits, lp_rows) if lp_rows else None
        sample_rows = [k for k, row in enumerate(rows) if row.kind == "sample"]
        tokens = None
        if sample_rows:
            every = len(sample_rows) == len(rows)
            sampled = logits if every else logits[to_device(sample_rows, self.device)]
            tokens = self.sampling_head.sample(
                reqs, [rows[k] for k in sample_rows], sampled, table_rows
            )
            out["tokens"] = tokens
            hidden = [k for k in sample_rows if reqs[rows[k].req].req.return_hidden_states]
            if hidden:
                out["hidden"] = selected[to_device(hidden, self.device)].float()
        if scored is not None:
            self.logprob_head.queue(reqs, rows, lp_rows, sample_rows, scored, tokens, out)

    def _build_decode(self, batch: ScheduleBatch) -> tuple[ForwardBatch, list[int], list[LogitRow]]:
        """Tensors for a decode forward, plus which hidden rows need outputs and why: one token
        per request, each sampled. The per-request ints go to the device in one copy (this runs
        every step, for every running request)."""
        starts = batch.starts
        seq_lens = [start + 1 for start in starts]
        host = torch.tensor(
            [[r.row for r in batch.reqs], starts, seq_lens, batch.extend_lens], dtype=torch.int64
        )
        on_device = host.to(self.device, non_blocking=True)
        req_pool_indices, positions, seq_lens_dev, extend_lens = on_device
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
        req_pool_indices = to_device([r.row for r in batch.reqs], dev)
        seq_lens = [start + ext for start, ext in zip(batch.starts, batch.extend_lens)]
        fb = ForwardBatch(
            mode=batch.mode,
            input_ids=to_device(input_ids, dev),
            positions=to_device(positions, dev),
            out_cache_loc=batch.out_cache_loc.to(dev, non_blocking=True),
            req_pool_indices=req_pool_indices,
            seq_lens=to_device(seq_lens, dev),
            extend_lens=to_device(batch.extend_lens, dev),
            req_to_token=self.req_to_token.table,
            kv_pool=self.kv_pool,
            attn_backend=self.attn_backend,
            seq_lens_cpu=seq_lens,
            extend_lens_cpu=list(batch.extend_lens),
        )
        return fb, hidden_rows, rows

    def _run_model(self, fb: ForwardBatch) -> torch.Tensor:
        """Hidden states of fb's tokens, [T, hidden]: from a CUDA graph where one fits."""
        if self.graph_runner is not None and self.graph_runner.can_replay(fb):
            return self.graph_runner.replay(fb)
        if self.extend_graphs is not None and self.extend_graphs.can_replay(fb):
            return self.extend_graphs.replay(fb)
        self.attn_backend.prepare(fb)
        return self.model(fb.input_ids, fb.positions, fb)
