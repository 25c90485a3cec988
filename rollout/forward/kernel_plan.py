"""KernelPlan: which kernels the engine runs, decided once at start.

KernelOptions say what was asked for ("auto" or a backend's name, switches, sizes); what can run
depends on the device, the dtype and the packages that import. `resolve_kernel_plan` is the one
place that weighs the two. The model runner, the CUDA-graph runner, the model's layers and the
sampler read the plan and decide nothing themselves; the plan is logged at start and reported
by get_server_info as `kernel_plan`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from rollout.config import EngineOptions
from rollout.forward import attention
from rollout.forward.attention import DecodeChoice
from rollout.kernel_options import KernelOptions

# "auto" takes the first of these that can run here, else torch.
AUTO_ORDER = ("flashinfer", "triton")
# Decode's "auto" by the attention backend, for decode batches of up to triton_decode_max_batch
# rows: the Triton decode kernel plans nothing on the host per step, which is what a small
# batch's step is short of.
DECODE_AUTO = {"flashinfer": "triton"}
# Weights below this many elements keep torch's GEMM on the skinny path. Reading one is short
# enough that the kernel's start weighs: each program streams one tile of rows through a
# pipeline it must first fill, and torch's GEMM, which also splits K, reads them as fast or
# faster (Qwen2.5-7B's q/k/v and o projections; the skinny kernel wins on gate/up, down and the
# LM head: benchmarks/bench_gemv.py, benchmarks/RESULTS.md).
SKINNY_MIN_WEIGHT = 1 << 25
# Decode batches replayed from CUDA graphs by default. An eager decode step of several hundred
# rows leaves the device waiting on the host's launches: Llama-3.1-8B's long rollouts at tp 2
# gain from graphs to 512, and the rl workload at tp 1 (up to 1,024 samples at once) from
# graphs to 1,024 (benchmarks/RESULTS.md, twenty-seventh and fortieth sessions).
GRAPH_MAX_BS = 1024
GRAPH_MAX_BS_TP = 512
# With filters (top-k, top-p, min-p) the sampling kernel gives one program to one row, which
# beats torch's ops only from a few dozen rows on (benchmarks/RESULTS.md); without
# filters it draws each row in chunks and wins at any number of rows.
SAMPLING_KERNEL_MIN_ROWS = 32


@dataclass(frozen=True)
class KernelPlan:
    """The kernels of this engine, resolved from KernelOptions for its device and dtype."""

    attention_backend: str  # extend (prefill, chunks), and decode batches above decode_max_batch
    decode_backend: str  # decode batches of up to decode_max_batch rows
    decode_max_batch: int | None  # None: every decode batch runs on decode_backend
    fused_kernels: bool  # the Triton norm, rotary and SiLU-and-mul kernels in the layers
    skinny_gemm_max_rows: int  # linear layers over at most this many tokens; 0: never
    skinny_gemm_min_weight: int  # ... whose weight has at least this many elements
    cuda_graphs: bool  # decode replayed from CUDA graphs
    cuda_graph_max_bs: int  # the largest batch replayed; 0 without graphs
    sampling_kernel: bool  # sampling on the Triton kernel ...
    sampling_kernel_min_rows: int  # ... for batches with filters from this many rows on
    # Batch-invariant kernels throughout (enable_deterministic_inference): the batch-invariant
    # GEMM in every linear layer and the LM head, the deterministic attention backend for
    # every step, and the sampling kernel launched once per filter set among the batch's rows
    # (sampling_per_filter_set: a row runs the passes of its own filters, whatever the batch).
    deterministic_inference: bool = False
    sampling_per_filter_set: bool = False
    # Logprobs from each row's logsumexp in one read of its logits (rollout_kernels.row_logsumexp)
    # rather than the [R, V] log-softmax; see engine/logprob_head.py.
    logprob_kernel: bool = False
    # Tensor parallelism: each row-parallel projection's all-reduce fused with the residual add
    # and the norm after it (enable_flashinfer_allreduce_fusion; forward/all_reduce_norm.py).
    allreduce_fusion: bool = False
    # Tensor parallelism: forwards of min_rows..max_rows rows sum each row-parallel projection
    # over the ranks with torch's two-shot all-reduce, the projection writing into a symmetric
    # buffer of max_rows rows (symm_mem_allreduce_min_rows; forward/symmetric_sum.py); 0: never.
    symm_mem_allreduce_min_rows: int = 0
    symm_mem_allreduce_max_rows: int = 0
    # The Triton kernels launched with programmatic dependent launch (rollout_kernels.pdl):
    # on a GPU of compute capability 9.0 or later unless disable_pdl.
    programmatic_launch: bool = False
    # Extends of up to this many new tokens replayed from CUDA graphs (engine/
    # extend_graph_runner.py); 0: every extend runs eagerly.
    extend_graph_max_tokens: int = 0
    # With adapters on a GPU: forwards of up to this many rows run LoRA's kernels beside the
    # base GEMMs (models/lora_layer.py, LoraLayer.around); 0: after them.
    lora_overlap_max_rows: int = 0
    # Decode batches of at least this many rows that decode_backend does not take run the
    # Triton decode kernel in pieces of large_decode_piece_keys keys (0: the unsplit kernel)
    # instead of attention_backend; 0: never.
    large_decode_min_batch: int = 0
    large_decode_piece_keys: int = 0

    @property
    def decode_attention(self) -> DecodeChoice:
        return DecodeChoice(
            self.decode_backend, self.decode_max_batch, self.large_decode_min_batch,
            self.large_decode_piece_keys,
        )  # fmt: skip

    def samples_with_kernel(self, rows: int, filtered: bool) -> bool:
        """Whether a sampling batch of `rows` rows (`filtered`: some use top-k/top-p/min-p)
        runs on the sampling kernel."""
        return self.sampling_kernel and (rows >= self.sampling_kernel_min_rows or not filtered)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        graphs = f"up to batch {self.cuda_graph_max_bs}" if self.cuda_graphs else "off"
        if self.extend_graph_max_tokens:
            graphs += f" and extends up to {self.extend_graph_max_tokens} tokens"
        skinny = f"up to {self.skinny_gemm_max_rows} rows" if self.skinny_gemm_max_rows else "off"
        fused = "on" if self.fused_kernels else "off"
        sampling = "kernel" if self.sampling_kernel else "torch"
        if self.sampling_per_filter_set:
            sampling = "kernel per filter set"
        return (
            f"attention {self.attention_backend}, decode {self.decode_attention}, fused kernels "
            f"{fused}, skinny GEMM {skinny}, CUDA graphs {graphs}, sampling {sampling}"
            + (", deterministic inference" if self.deterministic_inference else "")
            + (", all-reduce fused with the norms" if self.allreduce_fusion else "")
            + (
                f", symmetric-memory all-reduce from {self.symm_mem_allreduce_min_rows} to "
                f"{self.symm_mem_allreduce_max_rows} rows"
                if self.symm_mem_allreduce_min_rows
                else ""
            )
            + (", programmatic dependent launch" if self.programmatic_launch else "")
            + (
                f", LoRA beside the GEMMs up to {self.lora_overlap_max_rows} rows"
                if self.lora_overlap_max_rows
                else ""
            )
        )


def resolve_kernel_plan(
    options: EngineOptions, device: torch.device, dtype: torch.dtype, head_dim: int | None = None
) -> KernelPlan:
    """The plan for `options` on `device` in `dtype` (the model's resolved dtype) for attention
    heads of `head_dim` (None: any backend's); raises ValueError, naming why, when an explicitly
    named backend cannot run here."""
    kopts = options.kernels
    if kopts.enable_deterministic_inference:
        return _deterministic_plan(options, device)
    extend = _attention_backend(kopts.attention_backend, device, dtype, head_dim)
    decode = _decode_choice(
        kopts.decode_attention_backend, extend, device, dtype, head_dim,
        kopts.triton_decode_max_batch,
    )  # fmt: skip
    # The GPU backends come with the Triton kernels for norms, rotary, SiLU-and-mul and
    # sampling; attention_backend="torch" stays all torch: it is the reference path.
    fused = extend != "torch"
    # A CUDA graph captures NCCL collectives, not gloo's (which pass through the host).
    gloo_ranks = options.parallel.tp_size > 1 and options.parallel.tp_backend == "gloo"
    graphs = (
        device.type == "cuda"
        and not kopts.disable_cuda_graph
        and not gloo_ranks
        and attention.supports_cuda_graph(extend, decode)
    )
    max_bs = _graph_max_bs(options)
    symm_rows = _symm_mem_rows(options, device)
    large_min = _large_min_batch(kopts, extend, decode, device, dtype)
    return KernelPlan(
        attention_backend=extend,
        decode_backend=decode.backend,
        decode_max_batch=decode.max_batch,
        fused_kernels=fused,
        skinny_gemm_max_rows=kopts.skinny_gemm_max_rows if fused else 0,
        skinny_gemm_min_weight=SKINNY_MIN_WEIGHT,
        cuda_graphs=graphs,
        cuda_graph_max_bs=max_bs if graphs else 0,
        sampling_kernel=fused,
        sampling_kernel_min_rows=SAMPLING_KERNEL_MIN_ROWS,
        logprob_kernel=fused and device.type == "cuda",
        allreduce_fusion=_allreduce_fusion(options, device, dtype),
        symm_mem_allreduce_min_rows=symm_rows[0],
        symm_mem_allreduce_max_rows=symm_rows[1],
        programmatic_launch=fused and _pdl_supported(options, device),
        extend_graph_max_tokens=_extend_graph_max_tokens(options, extend, graphs),
        lora_overlap_max_rows=(
            kopts.lora_overlap_max_rows
            if options.lora.enable_lora and device.type == "cuda"
            else 0
        ),
        large_decode_min_batch=large_min,
        large_decode_piece_keys=kopts.large_decode_piece_keys if large_min else 0,
    )


def _large_min_batch(
    kopts: KernelOptions, extend: str, decode: DecodeChoice, device: torch.device,
    dtype: torch.dtype,
) -> int:  # fmt: skip
    """large_decode_min_batch as it applies: to the decode batches FlashInfer's decode would
    run (above the Triton decode kernel's, where FlashInfer's runs every extend), where its
    Triton kernel runs; 0 elsewhere."""
    flashinfer_decodes = decode.backend == extend or decode.max_batch is not None
    large = attention.large_decode_backend(kopts.large_decode_piece_keys)
    runs = attention.unavailable_reason(large, device, dtype) is None
    if extend != "flashinfer" or not flashinfer_decodes or not runs:
        return 0
    return kopts.large_decode_min_batch


def _extend_graph_max_tokens(options: EngineOptions, extend: str, graphs: bool) -> int:
    """The largest extend replayed from a graph: cuda_graph_max_extend_tokens, capped by the
    longest chunk; 0 without decode graphs, where the extend backend cannot be captured,
    or with adapters (their per-request segments are planned on the host for each extend). At
    tensor parallelism every rank captures the same buckets and replays the same one, the
    all-reduce inside the graph as in the decode graphs."""
    if not graphs or options.lora.enable_lora or not attention.supports_extend_graph(extend):
        return 0
    return min(options.kernels.cuda_graph_max_extend_tokens, options.scheduler.chunked_prefill_size)


def _pdl_supported(options: EngineOptions, device: torch.device) -> bool:
    if options.kernels.disable_pdl or device.type != "cuda":
        return False
    return gpu_capability(device) >= (9, 0)


def gpu_capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of `device`; (0, 0) where no GPU is present."""
    if not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def _graph_max_bs(options: EngineOptions) -> int:
    """cuda_graph_max_bs (unset: GRAPH_MAX_BS, or GRAPH_MAX_BS_TP at tp > 1), capped by
    max_running_requests once it is known (the runner resolves an unset one for its KV pool
    before it plans)."""
    running = options.scheduler.max_running_requests
    graphs = options.kernels.cuda_graph_max_bs
    if graphs is None:
        graphs = GRAPH_MAX_BS if options.parallel.tp_size == 1 else GRAPH_MAX_BS_TP
    return graphs if running is None else min(graphs, running)


def _allreduce_fusion(options: EngineOptions, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether enable_flashinfer_allreduce_fusion fuses here (there is nothing to fuse at
    tp_size 1); ValueError, naming why, where it cannot run."""
    if not options.kernels.enable_flashinfer_allreduce_fusion or options.parallel.tp_size == 1:
        return False
    name = "enable_flashinfer_allreduce_fusion"
    if device.type != "cuda" or options.parallel.tp_backend == "gloo":
        raise ValueError(f"{name} needs the ranks on GPUs over NCCL (tp_backend auto or nccl)")
    if dtype not in (torch.bfloat16, torch.float16):
        got = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name} needs dtype bfloat16 or float16, got {got}")
    if not attention.package_imports("flashinfer"):
        raise ValueError(f"{name} runs FlashInfer's kernel: pip install flashinfer-python")
    return True


def _symm_mem_rows(options: EngineOptions, device: torch.device) -> tuple[int, int]:
    """The plan's symm_mem_allreduce_min_rows and _max_rows: the option's rows up to the most
    one forward has (an extend's token budget, or a decode of every running request), on GPU
    ranks over NCCL; zero where there is no sum (tp_size 1), no GPU, or no forward that long."""
    min_rows = options.kernels.symm_mem_allreduce_min_rows
    parallel, sched = options.parallel, options.scheduler
    extend = min(sched.chunked_prefill_size, sched.max_prefill_tokens)
    max_rows = max(extend, sched.max_running_requests or 0)
    gpu_ranks = device.type == "cuda" and parallel.tp_backend != "gloo"
    if not min_rows or parallel.tp_size == 1 or not gpu_ranks or min_rows > max_rows:
        return 0, 0
    return min_rows, max_rows


def _deterministic_plan(options: EngineOptions, device: torch.device) -> KernelPlan:
    """The plan of enable_deterministic_inference: batch-invariant kernels on every step."""
    kopts = options.kernels
    asked = {"attention_backend": kopts.attention_backend,
             "decode_attention_backend": kopts.decode_attention_backend}  # fmt: skip
    for name, value in asked.items():
        if value != "auto":
            raise ValueError(
                f"enable_deterministic_inference runs its own attention kernel; leave {name} "
                f"auto, got {value!r}"
            )
    if importlib.util.find_spec("triton") is None:
        raise ValueError(
            "enable_deterministic_inference runs Triton kernels (under TRITON_INTERPRET=1 on a "
            "CPU): pip install triton"
        )
    # Adapter deltas and tensor-parallel sums are not batch-invariant yet.
    if options.lora.enable_lora:
        raise ValueError("enable_deterministic_inference does not support enable_lora yet")
    if options.parallel.tp_size > 1:
        raise ValueError(
            f"enable_deterministic_inference needs tp_size 1, got {options.parallel.tp_size}"
        )
    graphs = device.type == "cuda" and not kopts.disable_cuda_graph
    max_bs = _graph_max_bs(options)
    return KernelPlan(
        attention_backend="deterministic",
        decode_backend="deterministic",
        decode_max_batch=None,
        fused_kernels=True,
        skinny_gemm_max_rows=0,
        skinny_gemm_min_weight=SKINNY_MIN_WEIGHT,
        cuda_graphs=graphs,
        cuda_graph_max_bs=max_bs if graphs else 0,
        # The kernel's passes follow the batch's filters (a row without top-p runs the top-p
        # pass when another row has one): here each filter set's rows get a launch of their own.
        sampling_kernel=False,
        sampling_kernel_min_rows=SAMPLING_KERNEL_MIN_ROWS,
        deterministic_inference=True,
        sampling_per_filter_set=True,
    )


def _attention_backend(
    name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None
) -> str:
    """The backend to build for attention_backend=`name`."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if candidate in attention.BACKENDS and _runs(candidate, device, dtype, head_dim):
                return candidate
        return "torch"
    return _named_backend(
        "attention_backend", name, device, dtype, head_dim, "; use auto or torch"
    )


def _decode_choice(
    name: str, extend: str, device: torch.device, dtype: torch.dtype, head_dim: int | None,
    auto_max_batch: int,
) -> DecodeChoice:  # fmt: skip
    """Where decode runs for decode_attention_backend=`name`, given the resolved attention
    backend `extend` and, for "auto", the largest decode batch on DECODE_AUTO's backend."""
    if name == "auto":
        preferred = DECODE_AUTO.get(extend)
        runs = preferred is not None and _runs(preferred, device, dtype, head_dim)
        if runs and auto_max_batch > 0:
            return DecodeChoice(preferred, auto_max_batch)
        return DecodeChoice(extend)
    return DecodeChoice(
        _named_backend("decode_attention_backend", name, device, dtype, head_dim)
    )


def _runs(name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None) -> bool:
    return attention.unavailable_reason(name, device, dtype, head_dim) is None


def _named_backend(
    option: str, name: str, device: torch.device, dtype: torch.dtype, head_dim: int | None,
    hint: str = "",
) -> str:
    """`name` as given for `option`, once it is known and can run here; else ValueError."""
    if name not in attention.BACKENDS:
        known = ", ".join(attention.BACKENDS)
        raise ValueError(f"{option} must be one of auto, {known}, got {name!r}")
    reason = attention.unavailable_reason(name, device, dtype, head_dim)
    if reason is not None:
        raise ValueError(f"{option}={name!r} cannot run here: {reason}{hint}")
    return name
