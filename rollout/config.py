"""Engine options, split by the component that reads them.

Each dataclass is frozen: options are decided once, at construction, and never mutated. The
CLI (and `RolloutEngine(**options)`) is generated from these fields; the `help` metadata is the
text users see.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from rollout.kernel_options import KernelOptions
from rollout.lora_options import LoraOptions
from rollout.option_field import option as _opt

KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
# The default max_running_requests (SchedulerOptions.running_limit): one request per this many
# tokens of the KV pool, within these bounds. Batches past cuda_graph_max_bs run eagerly.
RUNNING_TOKENS_PER_REQUEST = 1024
MIN_RUNNING_REQUESTS = 256
MAX_RUNNING_REQUESTS = 2048


@dataclass(frozen=True)
class ModelOptions:
    model_path: str = _opt("", "Hugging Face checkpoint directory (config.json + safetensors)")
    tokenizer_path: str | None = _opt(None, "tokenizer directory; defaults to model_path")
    dtype: str = _opt("auto", "weight/activation dtype: auto, bfloat16, float16, float32")
    device: str | None = _opt(None, "cuda or cpu; defaults to cuda when available")
    context_length: int | None = _opt(None, "max tokens per sequence; defaults to the model's")
    load_format: str = _opt("auto", "auto: weights from the checkpoint; dummy: random weights")
    random_seed: int = _opt(0, "seed for requests that give none of their own")
    is_embedding: bool = _opt(
        False,
        "serve encode/classify instead of generation: prompts are prefilled only and answered "
        "with the last token's final hidden state (a causal LM) or its score head's outputs "
        "(a *ForSequenceClassification checkpoint, which needs this option)",
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(
                f"dtype must be one of auto, bfloat16, float16, float32, got {self.dtype!r}"
            )
        if self.device is not None and self.device.split(":")[0] not in ("cuda", "cpu"):
            raise ValueError(f"device must be cuda or cpu, got {self.device!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {self.context_length}")


@dataclass(frozen=True)
class CacheOptions:
    max_total_tokens: int | None = _opt(
        None, "KV pool size in tokens; defaults to mem_fraction of free GPU memory (4096 on CPU)"
    )
    mem_fraction: float = _opt(0.85, "fraction of free GPU memory for weights, KV and graphs")
    disable_radix_cache: bool = _opt(False, "turn the radix prefix cache off")
    kv_cache_dtype: str = _opt(
        "auto",
        "element type of the KV cache: auto (the model's dtype), fp8_e4m3 or fp8_e5m2 (one byte "
        "per element, no scaling: values beyond the format's range are clamped to it; twice the "
        "tokens in the same memory and half the bytes each decode step reads, at some accuracy)",
    )

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < 16:
            raise ValueError(f"max_total_tokens must be >= 16, got {self.max_total_tokens}")
        if not 0.0 < self.mem_fraction < 1.0:
            raise ValueError(f"mem_fraction must be in (0, 1), got {self.mem_fraction}")


@dataclass(frozen=True)
class SchedulerOptions:
    chunked_prefill_size: int = _opt(8192, "max prompt tokens prefilled in one step")
    max_running_requests: int | None = _opt(
        None,
        "max requests decoding at once; default: one per 1024 tokens of the KV pool, at least "
        "256 and at most 2048 (get_server_info reports the value in force)",
    )
    max_prefill_tokens: int = _opt(16384, "token budget of one prefill step, prefixes excluded")
    disable_overlap_schedule: bool = _opt(
        False,
        "finish each step before planning the next, instead of preparing step k+1 on the host "
        "while the device computes step k",
    )
    schedule_conservativeness: float = _opt(
        1.0,
        "how much KV a new request must leave free for the running ones' future tokens: 1 "
        "reserves an estimate learned from retractions, higher admits fewer requests (fewer "
        "retractions), 0 reserves nothing",
    )
    skip_server_warmup: bool = _opt(
        False, "on a GPU, report ready without first running the warm-up requests that compile "
        "the prefill, sampling and logprob kernels (else the first requests compile them)",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if not self.schedule_conservativeness >= 0:
            raise ValueError(
                f"schedule_conservativeness must be >= 0, got {self.schedule_conservativeness}"
            )
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")

    def running_limit(self, pool_tokens: int) -> int:
        """max_running_requests, or by default the limit for a KV pool of `pool_tokens`: a
        long-output workload decodes larger batches the more requests fit, so the default grows
        with the pool; each allowed request keeps a req->token row of the context's length."""
        if self.max_running_requests is not None:
            return self.max_running_requests
        by_pool = pool_tokens // RUNNING_TOKENS_PER_REQUEST
        return max(MIN_RUNNING_REQUESTS, min(MAX_RUNNING_REQUESTS, by_pool))


BACKUPS = ("cpu", "device", "auto")


@dataclass(frozen=True)
class WeightSyncOptions:
    weight_update_backup: str = _opt(
        "cpu",
        "where an update that can fail midway keeps the values it overwrites until it commits: "
        "cpu (pinned host memory), device (faster; needs free device memory the size of the "
        "update), or auto (on the device while it has room, e.g. with the KV cache released, "
        "else on the host)",
    )
    weight_sync_timeout_s: float = _opt(
        300.0, "seconds to wait for the trainer when joining an update group and for each broadcast"
    )
    enable_weights_cpu_backup: bool = _opt(
        False,
        "keep a CPU copy of the weights while their GPU memory is released, so that resume "
        "restores them; without it, push new weights after resume",
    )

    def __post_init__(self) -> None:
        if self.weight_update_backup not in BACKUPS:
            raise ValueError(
                f"weight_update_backup must be one of {', '.join(BACKUPS)}, got "
                f"{self.weight_update_backup!r}"
            )
        if not self.weight_sync_timeout_s > 0:
            raise ValueError(f"weight_sync_timeout_s must be > 0, got {self.weight_sync_timeout_s}")


MAX_SAMPLES_PER_CALL = 16384  # prompts x n of one call: bounds the work of one request body


@dataclass(frozen=True)
class RequestOptions:
    """Bounds on what one call may ask for. Each is checked before any work is done; a call
    beyond one is a ValueError (HTTP 400) naming the option and the value."""

    # Real text averages 3-5 bytes per token. A token is at least one byte, so the bound also
    # caps the tokens of one prompt, and with them the tokenizer's time, memory and the slices
    # in which it holds the GIL (benchmarks/RESULTS.md has what they cost).
    max_bytes_per_token: int = _opt(
        16,
        "prompt texts longer than context_length x this many bytes (UTF-8) are refused before "
        "tokenizing: no such text fits the context",
    )
    max_n: int = _opt(
        1024, f"largest n (samples of one prompt) of a request; at most {MAX_SAMPLES_PER_CALL}"
    )
    max_top_logprobs_num: int = _opt(256, "largest top_logprobs_num of a request")
    max_logprob_entries: int = _opt(
        2**22,
        "most top-logprob and token_ids_logprob entries one call may return: the sum over its "
        "samples of logprob positions (the prompt's from logprob_start_len, plus the tokens "
        "max_new_tokens allows) x (top_logprobs_num + len(token_ids_logprob))",
    )
    allow_user_chat_template: bool = _opt(
        False,
        "accept a caller's own template (chat_template in chat_template_kwargs), rendered in "
        "Jinja's sandbox for at most chat_template_timeout_s; allow it only for trusted callers, "
        "as one template operation can still take much memory",
    )
    chat_template_timeout_s: float = _opt(
        2.0, "longest a caller's own chat template may render (with allow_user_chat_template)"
    )

    def __post_init__(self) -> None:
        if self.max_bytes_per_token < 1:
            raise ValueError(f"max_bytes_per_token must be >= 1, got {self.max_bytes_per_token}")
        if not 1 <= self.max_n <= MAX_SAMPLES_PER_CALL:
            raise ValueError(f"max_n must be in [1, {MAX_SAMPLES_PER_CALL}], got {self.max_n}")
        if self.max_top_logprobs_num < 0:
            raise ValueError(f"max_top_logprobs_num must be >= 0, got {self.max_top_logprobs_num}")
        if self.max_logprob_entries < 0:
            raise ValueError(f"max_logprob_entries must be >= 0, got {self.max_logprob_entries}")
        if not self.chat_template_timeout_s > 0:
            raise ValueError(
                f"chat_template_timeout_s must be > 0, got {self.chat_template_timeout_s}"
            )


@dataclass(frozen=True)
class ParallelOptions:
    tp_size: int = _opt(1, "tensor parallelism: split every layer over this many GPUs (ranks)")
    base_gpu_id: int = _opt(0, "the GPU of rank 0; rank r runs on GPU base_gpu_id + r")
    gpu_ids: tuple[int, ...] | None = _opt(
        None, "the GPU of each rank, in rank order (repeatable); overrides base_gpu_id"
    )
    tp_backend: str = _opt(
        "auto",
        "how the ranks communicate: auto (nccl on GPUs, gloo on the host), nccl, or gloo (eager "
        "only; lets several ranks share one GPU, for tests)",
    )

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be an int >= 1, got {self.tp_size!r}")
        if not isinstance(self.base_gpu_id, int) or self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be an int >= 0, got {self.base_gpu_id!r}")
        if self.gpu_ids is not None:
            try:
                ids = tuple(int(i) for i in self.gpu_ids)
            except (TypeError, ValueError):
                raise ValueError(f"gpu_ids must be GPU indices, got {self.gpu_ids!r}") from None
            shared = self.tp_backend == "gloo"  # NCCL needs one GPU per rank
            if (
                len(ids) != self.tp_size
                or (len(set(ids)) != len(ids) and not shared)
                or min(ids) < 0
            ):
                raise ValueError(
                    f"gpu_ids must name {self.tp_size} distinct GPUs (one per rank), got {list(ids)}"
                )
            object.__setattr__(self, "gpu_ids", ids)
        if self.tp_backend not in ("auto", "nccl", "gloo"):
            raise ValueError(f"tp_backend must be auto, nccl or gloo, got {self.tp_backend!r}")

    def gpu_of(self, rank: int) -> int:
        return self.gpu_ids[rank] if self.gpu_ids is not None else self.base_gpu_id + rank


@dataclass(frozen=True)
class EngineOptions:
    model: ModelOptions
    kernels: KernelOptions = field(default_factory=KernelOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    weight_sync: WeightSyncOptions = field(default_factory=WeightSyncOptions)
    requests: RequestOptions = field(default_factory=RequestOptions)
    parallel: ParallelOptions = field(default_factory=ParallelOptions)
    lora: LoraOptions = field(default_factory=LoraOptions)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineOptions:
        """Builds the options from flat keyword arguments; unknown names raise TypeError."""
        kwargs = {_ALIASES.get(k, k): v for k, v in kwargs.items()}
        parts: dict[str, dict[str, Any]] = {}
        for name, part_cls in _PARTS.items():
            names = {f.name for f in dataclasses.fields(part_cls)}
            parts[name] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        if kwargs:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        return cls(**{name: _PARTS[name](**values) for name, values in parts.items()})


# Other names accepted for an option by from_kwargs.
_ALIASES = {"deterministic_inference": "enable_deterministic_inference"}

_PARTS = {
    "model": ModelOptions,
    "kernels": KernelOptions,
    "cache": CacheOptions,
    "scheduler": SchedulerOptions,
    "weight_sync": WeightSyncOptions,
    "requests": RequestOptions,
    "parallel": ParallelOptions,
    "lora": LoraOptions,
}


def check_model_path(model_path: str) -> None:
    """Raises FileNotFoundError unless `model_path` is a checkpoint directory (config.json)."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(
            f"model_path must be a checkpoint directory with config.json, got {model_path!r}"
        )


def option_fields() -> list[dataclasses.Field]:
    """Every flat option, in declaration order (for the CLI)."""
    return [f for part in _PARTS.values() for f in dataclasses.fields(part)]
