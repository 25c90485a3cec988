"""The engine's kernel options: which attention backends, fused kernels and CUDA graphs it asks
for. Part of EngineOptions (rollout/config.py) as its `kernels` part; rollout.forward.kernel_plan
resolves them into the KernelPlan the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

from rollout.option_field import option as _opt

ATTENTION_BACKENDS = ("auto", "flashinfer", "triton", "torch")
# The most rows the skinny GEMM kernel takes: rollout_kernels.skinny_gemm.MAX_ROWS, restated here
# because config does not import Triton (a test checks the two agree).
SKINNY_GEMM_MAX_ROWS = 16


@dataclass(frozen=True)
class KernelOptions:
    """Which kernels run where. These are requests: rollout.forward.kernel_plan resolves them
    against the device, dtype and installed packages into the KernelPlan the engine runs."""

    attention_backend: str = _opt(
        "auto",
        "attention implementation: auto (flashinfer on a GPU where it imports and the dtype is "
        "float16/bfloat16, else triton on a GPU, else torch), flashinfer, triton, torch",
    )
    decode_attention_backend: str = _opt(
        "auto",
        "attention implementation of decode steps: auto (where attention_backend resolves to "
        "flashinfer: triton for decode batches of up to triton_decode_max_batch rows, flashinfer "
        "above; else the same as attention_backend), flashinfer, triton, torch",
    )
    # The Triton decode kernel plans nothing on the host per step, which wins at small batches;
    # FlashInfer's decode catches up at a few dozen rows and wins on large batches. The default
    # keeps Triton's on the batch sizes where it was faster inside the engine and gives
    # FlashInfer's those from where the two were about even (benchmarks/RESULTS.md, "Which
    # decode kernel at which batch size").
    triton_decode_max_batch: int = _opt(
        32,
        "with decode_attention_backend auto under flashinfer: the largest decode batch (a CUDA "
        "graph's padded size) on the Triton decode kernel; 0: none",
    )
    # With a few long requests among short ones, FlashInfer's decode waits on one program per
    # long request, where the Triton decode kernel in pieces of 4,096 keys cuts them. From 80
    # rows (the graphs above 64) the agent workload gained most, nano a little, rl kept its
    # speed; at 33-64 rows the pieces made rl's steps longer (benchmarks/RESULTS.md,
    # forty-third and forty-fourth sessions).
    large_decode_min_batch: int = _opt(
        80,
        "under flashinfer: decode batches of at least this many rows (a CUDA graph's padded "
        "size) above the Triton decode kernel's run a Triton kernel instead of FlashInfer's "
        "decode: the decode kernel cutting each request's keys into pieces of "
        "large_decode_piece_keys keys, or with large_decode_piece_keys 0 the unsplit kernel (the "
        "deterministic mode's attention: one program over all of a request's keys for each KV "
        "head); 0: never",
    )
    large_decode_piece_keys: int = _opt(
        4096,
        "keys per piece of a request on the large decode batches' Triton kernel "
        "(large_decode_min_batch): shorter requests are one program for each KV head, longer "
        "ones one per piece (at most 16, longer pieces past that); 0: the unsplit kernel",
    )
    # A small decode batch only streams the weights, which the skinny kernel does faster than
    # torch's GEMM up to 16 rows on Qwen2.5-7B; with more rows it gained nothing
    # (benchmarks/RESULTS.md, ninth session).
    skinny_gemm_max_rows: int = _opt(
        16,
        "on the GPU backends, linear layers over at most this many tokens (small decode "
        "batches) run the skinny GEMM kernel of kernels/ instead of torch's GEMM; 0: never",
    )
    # LoRA's kernels at a decode batch of up to ~128 rows are launches more than reads; beside
    # the base GEMMs they mostly hide; at 256 rows they gain nothing (benchmarks/RESULTS.md,
    # thirty-first session).
    lora_overlap_max_rows: int = _opt(
        128,
        "with LoRA adapters on a GPU, forwards of at most this many tokens run each projection's "
        "LoRA kernels on a second stream beside its base GEMM, and the delta of a projection "
        "followed by a norm or SiLU-and-mul is added by that kernel; 0: never",
    )
    disable_cuda_graph: bool = _opt(False, "run decode eagerly instead of replaying CUDA graphs")
    disable_pdl: bool = _opt(
        False,
        "launch the Triton kernels one after another's end instead of with programmatic "
        "dependent launch (on Hopper and later GPUs, each kernel otherwise starts while the one "
        "before it ends: rollout_kernels.pdl)",
    )
    cuda_graph_max_bs: int | None = _opt(
        None,
        "largest decode batch replayed from a CUDA graph (capped by max_running_requests); "
        "larger batches run eagerly. Default 1024 at tp_size 1, 512 above",
    )
    cuda_graph_max_extend_tokens: int = _opt(
        512,
        "largest extend (prefill, chunk or turn over a cached prefix) replayed from a CUDA "
        "graph, in new tokens over at most 32 requests (capped by chunked_prefill_size; "
        "FlashInfer's extend, without adapters); 0: every extend runs eagerly",
    )
    enable_deterministic_inference: bool = _opt(
        False,
        "batch-invariant kernels on the whole forward (GEMMs, norms, one attention kernel for "
        "prefill and decode, sampling): a request's tokens and logprobs are the same bits "
        "whatever else is batched, with or without the prefix cache, chunked prefill or CUDA "
        "graphs; replaces the attention backend choice (also deterministic_inference=True)",
    )
    enable_flashinfer_allreduce_fusion: bool = _opt(
        False,
        "with tensor parallelism on GPUs (bf16/fp16), sum each row-parallel projection over "
        "the ranks, add the residual and RMS-normalise in one FlashInfer kernel (peer to peer "
        "over NVLink) for batches of up to FUSED_MAX_TOKENS (forward/all_reduce_norm.py), "
        "instead of an NCCL all-reduce and a norm kernel; nothing to fuse at tp_size 1",
    )
    # Off: no gain over NCCL shown inside the engine (benchmarks/RESULTS.md).
    symm_mem_allreduce_min_rows: int = _opt(
        0,
        "with tensor parallelism on GPUs, forwards of at least this many tokens (up to the "
        "longest a step can have) sum o_proj's and down_proj's partial outputs with torch's "
        "two-shot all-reduce over symmetric memory, each projection writing its output "
        "straight into the symmetric buffer, instead of NCCL's all-reduce "
        "(forward/symmetric_sum.py); 0: never",
    )

    def __post_init__(self) -> None:
        for name in ("attention_backend", "decode_attention_backend"):
            value = getattr(self, name)
            if value not in ATTENTION_BACKENDS:
                raise ValueError(
                    f"{name} must be one of {', '.join(ATTENTION_BACKENDS)}, got {value!r}"
                )
        if self.triton_decode_max_batch < 0:
            raise ValueError(
                f"triton_decode_max_batch must be >= 0, got {self.triton_decode_max_batch}"
            )
        for name in ("large_decode_min_batch", "large_decode_piece_keys"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.skinny_gemm_max_rows <= SKINNY_GEMM_MAX_ROWS:
            raise ValueError(
                f"skinny_gemm_max_rows must be in 0..{SKINNY_GEMM_MAX_ROWS}, "
                f"got {self.skinny_gemm_max_rows}"
            )
        if self.lora_overlap_max_rows < 0:
            raise ValueError(
                f"lora_overlap_max_rows must be >= 0, got {self.lora_overlap_max_rows}"
            )
        if self.symm_mem_allreduce_min_rows < 0:
            raise ValueError(
                f"symm_mem_allreduce_min_rows must be >= 0, got {self.symm_mem_allreduce_min_rows}"
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.cuda_graph_max_extend_tokens < 0:
            raise ValueError(
                f"cuda_graph_max_extend_tokens must be >= 0, got {self.cuda_graph_max_extend_tokens}"
            )
