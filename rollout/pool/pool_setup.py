"""The pool's own options, and what it learns from its first replica at start."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout.config import EngineOptions
from rollout.pool.adapter_source import AdapterSources
from rollout.pool.router import Router
from rollout.pool.weight_source import WeightSource
from rollout.weight_sync.specs import parse_dtype


@dataclass(frozen=True)
class PoolOptions:
    # Routing (router.py): prefix blocks of this many tokens; a prefix match is ignored when
    # its replica has more than max_imbalance_tokens outstanding above the least loaded one.
    prefix_block_size: int = 16
    max_imbalance_tokens: int = 1 << 16
    # Faults (supervisor.py): seconds between health checks (0: only calls find deaths),
    # failed restarts in a row before a replica is given up, and how long a request waits for
    # a replica to come back when none serves.
    health_check_s: float = 2.0
    max_restarts: int = 3
    wait_for_replica_s: float = 300.0
    # Restoring a restarted replica's weights (weight_source.py): keep a CPU copy of tensor
    # updates; a callable returning the trainer's current weights (after distributed updates).
    keep_tensor_snapshot: bool = True
    restore_weights: Callable[[], Any] | None = None
    # The same for a LoRA adapter after distributed updates of it (adapter_source.py): called
    # with the adapter's name, returns its current values (a PEFT model, or PEFT name -> tensor).
    restore_adapter: Callable[[str], Any] | None = None

    def __post_init__(self) -> None:
        if self.health_check_s < 0 or self.wait_for_replica_s < 0 or self.max_restarts < 0:
            raise ValueError(
                "health_check_s, wait_for_replica_s and max_restarts must be >= 0, got "
                f"{self.health_check_s}, {self.wait_for_replica_s}, {self.max_restarts}"
            )

    def make_router(self, num_replicas: int) -> Router:
        return Router(
            num_replicas, block_size=self.prefix_block_size,
            max_imbalance_tokens=self.max_imbalance_tokens,
        )  # fmt: skip

    def make_source(self, info: dict[str, Any]) -> WeightSource:
        return WeightSource(
            info["weight_version"], parse_dtype(info["dtype"]), self.keep_tensor_snapshot,
            self.restore_weights,
        )  # fmt: skip

    def make_adapter_sources(self, info: dict[str, Any]) -> AdapterSources:
        """The adapters the replicas load at start (lora_paths), with their labels."""
        sources = AdapterSources(self.restore_adapter)
        sources.started_with(dict(info.get("lora_weight_versions") or {}))
        return sources


def describe(
    model_path: str, engine_options: dict[str, Any], info: dict[str, Any]
) -> tuple[EngineOptions, dict[str, Any], Any, Any]:
    """(options, info, tokenizer, limits) as a RolloutEngine of the replicas' model has them:
    what the HTTP app and validate_generate read."""
    from transformers import AutoTokenizer

    from rollout.engine.request_limits import RequestLimits

    known = {k: v for k, v in engine_options.items() if k != "model_path"}
    options = EngineOptions.from_kwargs(model_path=model_path, **known)
    tokenizer = AutoTokenizer.from_pretrained(options.model.tokenizer_path or model_path)
    keys = ("architecture", "vocab_size", "context_length", "model_path", "dtype", "tp_size")
    summary = {k: info.get(k) for k in keys}
    return options, summary, tokenizer, RequestLimits(info["context_length"], options.requests)


def is_classifier(model_path: str) -> bool:
    from rollout.engine.embedding_requests import is_classifier_checkpoint

    try:
        return is_classifier_checkpoint(model_path)
    except OSError:
        return False
