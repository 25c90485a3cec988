"""EnginePort: everything a weight-sync call may do to the engine it runs in.

The weight-sync layer never imports the engine: the scheduler process gives it an EnginePort
(engine/weight_sync_port.py adapts the Scheduler and the ModelRunner). Every method is called
on the scheduler's thread, between steps, with no batch in flight: the engine drains before it
runs a control call.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from rollout.forward.tensor_parallel import Shard

if TYPE_CHECKING:  # transformers is slow to import; the trainer's side never needs it
    from transformers import PretrainedConfig


class WeightModel(Protocol):
    """What weight sync uses of a model (every model of rollout.models has it): its weights by
    Hugging Face name (full checkpoint shapes, whatever this rank holds of them), and the
    nn.Module parameters and buffers behind them."""

    def hf_param_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def hf_weight(self, hf_name: str) -> torch.Tensor:
        """The parameter (or the slice of a fused one) that holds weight `hf_name`."""
        ...

    def hf_shard(self, hf_name: str) -> Shard | None:
        """The slice of the full tensor `hf_name` this tensor-parallel rank holds (None: all)."""
        ...

    def is_ignored_weight(self, hf_name: str) -> bool: ...

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], presharded: bool = False
    ) -> set[str]:
        """Full tensors (this rank keeps its slice), or with `presharded` this rank's slices."""
        ...

    def parameters(self) -> Iterator[nn.Parameter]: ...

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def get_buffer(self, target: str) -> torch.Tensor: ...


class AdapterPort(Protocol):
    """The engine's loaded LoRA adapters, as weight sync updates them (rollout/engine/
    lora_manager.py). Tensors are PEFT-named; every refusal is an InvalidRequest naming what
    is wrong, raised before anything is written."""

    def version_of(self, name: str) -> str:
        """Adapter `name`'s version label; InvalidRequest when none of that name is loaded."""
        ...

    def check_values(self, name: str, shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
        """Checks tensors of these names and shapes as new values of some of the modules of
        adapter `name` (each with both halves, at its rank), before any arrives."""
        ...

    def write_values(self, name: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Writes checked values into the adapter's slot; the number of modules written."""
        ...

    def read(self, name: str, path: str, roots: Sequence[str] | None) -> Any:
        """The PEFT adapter directory `path`, read and checked to replace adapter `name`
        whole (Forbidden for a file outside `roots`)."""
        ...

    def replace(self, name: str, adapter: Any, path: str) -> None:
        """Writes an adapter `read` gave over adapter `name`."""
        ...


class EnginePort(Protocol):
    @property
    def model(self) -> WeightModel: ...

    @property
    def hf_config(self) -> PretrainedConfig:
        """The serving checkpoint's config: a disk update must describe the same network."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def weight_version(self) -> str:
        """The version outputs are stamped with now."""
        ...

    # ---- generation ---------------------------------------------------------------------------
    def hold(self, reason: str) -> None:
        """Stops stepping until every reason is released; requests wait meanwhile."""
        ...

    def release_hold(self, reason: str) -> None: ...

    def held_by(self) -> list[str]:
        """The reasons stepping is held, sorted (empty: it steps)."""
        ...

    def count_requests(self) -> int:
        """Requests running or waiting."""
        ...

    def abort_all(self) -> None:
        """Finishes every request with finish_reason abort."""
        ...

    def retract_all(self) -> int:
        """Puts every running request back in the queue, its KV released (it re-prefills once
        stepping resumes). Returns how many were retracted."""
        ...

    def publish_weight_version(self, version: str, weights_changed: bool) -> None:
        """Outputs from the next step carry `version`; with `weights_changed`, no request
        attached later reuses KV computed with the older weights."""
        ...

    # ---- LoRA adapters ------------------------------------------------------------------------
    @property
    def adapters(self) -> AdapterPort | None:
        """The engine's LoRA adapters; None when it serves none."""
        ...

    def publish_adapter_version(self, name: str, version: str | None) -> str:
        """After new values of adapter `name`: outputs of its requests carry `version` (None:
        its label kept), and no request attached later reuses KV of its older values. Returns
        the label."""
        ...

    # ---- memory -----------------------------------------------------------------------------
    def flush_prefix_cache(self) -> None:
        """Forgets every cached prefix (call with no request holding KV, e.g. after
        retract_all)."""
        ...

    @property
    def releases_memory(self) -> bool:
        """Whether releasing a region gives its physical memory back (torch-memory-saver on a
        GPU); on the host only the KV pool is freed."""
        ...

    def release_region(self, tag: str) -> bool:
        """Gives back the memory of region `tag` (weights, kv_cache, cuda_graph). Returns
        whether its device memory went, and its values with it. On the host there are no
        regions: the KV pool itself is freed (and False returned)."""
        ...

    def resume_region(self, tag: str) -> None:
        """Backs region `tag` with memory again (the host's KV pool: allocated anew). What it
        held is back only where nothing was given back."""
        ...

    @property
    def kv_cache_bytes(self) -> int: ...
