"""The weight-sync calls, one frozen dataclass each (see rollout/control.py).

Each is checked where it is built (InvalidRequest / InvalidRequestType before anything is sent)
and holds plain data, so it crosses to the scheduler as JSON. The scheduler answers
{"success": True, "message": str, ...}; a failure is raised as InvalidRequest (the update did not
fit the model), Forbidden (a checkpoint file outside the allowed weight roots) or WeightSyncError
(the transfer failed): either way the weights and version are as before unless the message says
otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from rollout.control import ControlCall, check_bool, is_int, nonempty_str, settle
from rollout.errors import InvalidRequest, InvalidRequestType
from rollout.weight_sync import disk_source, distributed_source
from rollout.weight_sync.memory import check_tags
from rollout.weight_sync.serialized_tensors import as_text, bucket_pairs
from rollout.weight_sync.specs import WeightSpec, build_specs, dtype_name, parse_dtype
from rollout.weight_sync.tensor_handles import TensorHandles, share_tensors
from rollout.weight_sync.tensor_payloads import (
    NamedTensors,
    check_tensor_format,
    for_rank,
    handles_of,
    per_rank,
    serialized,
    sglang_bucket,
    tensor_source,
)
from rollout.weight_sync.update_group import check_group_args
from rollout.weight_sync.versions import check_version

DEFAULT_GROUP = "weight_update_group"
PAUSE_MODES = ("abort", "retract", "in_place")


def _flush_cache(value: Any) -> None:
    # NOTE: either value is accepted (SGLang trainers send False on every bucket but the last):
    # KV computed with older weights is never reused whatever it says (see the controller).
    check_bool(value, "flush_cache")


def _lora_name(value: Any) -> None:
    if value is not None:
        nonempty_str(value, "lora_name")


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidRequest(f"timeout_s must be a positive number of seconds, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class InitWeightsUpdateGroup(ControlCall):
    """Join the trainer's update group (the trainer is rank 0 and hosts it) as rank_offset."""

    method: ClassVar[str] = "init_weights_update_group"
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"
    timeout_s: float | None = None  # None: the engine's weight_sync_timeout_s

    def __post_init__(self) -> None:
        if not is_int(self.rank_offset) or self.rank_offset < 1:
            raise InvalidRequest(
                f"rank_offset must be an int >= 1 (the trainer is rank 0), got {self.rank_offset!r}"
            )
        check_group_args(
            self.master_address, self.master_port, self.rank_offset, self.world_size,
            self.group_name, self.backend,
        )  # fmt: skip
        settle(self, "timeout_s", _timeout(self.timeout_s))


@dataclass(frozen=True)
class DestroyWeightsUpdateGroup(ControlCall):
    method: ClassVar[str] = "destroy_weights_update_group"
    group_name: str = DEFAULT_GROUP

    def __post_init__(self) -> None:
        nonempty_str(self.group_name, "group_name")


@dataclass(frozen=True)
class UpdateWeightsFromDistributed(ControlCall):
    """Receive these tensors from rank 0's broadcasts (order: see distributed_source)."""

    method: ClassVar[str] = "update_weights_from_distributed"
    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtypes or their names; held as names
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None
    abort_all_requests: bool = False  # end every request in flight first (SGLang's meaning)
    # The loaded LoRA adapter whose values these are (PEFT names): see adapter_update.py.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        _lora_name(self.lora_name)
        specs = build_specs(self.names, self.dtypes, self.shapes)
        settle(self, "names", tuple(s.name for s in specs))
        settle(self, "dtypes", tuple(dtype_name(s.dtype) for s in specs))
        settle(self, "shapes", tuple(s.shape for s in specs))
        distributed_source.check_load_format(self.load_format)
        _flush_cache(self.flush_cache)
        check_version(self.weight_version)
        check_bool(self.abort_all_requests, "abort_all_requests")

    @property
    def specs(self) -> list[WeightSpec]:
        return [
            WeightSpec(n, shape, parse_dtype(d))
            for n, d, shape in zip(self.names, self.dtypes, self.shapes)
        ]


@dataclass(frozen=True)
class UpdateWeightsFromTensor(ControlCall):
    """Load tensors shared by reference (CUDA IPC handles, or shared memory on the host).
    `load_format` says how the sender gave them (see `share`). Every tensor is the full
    checkpoint tensor (each tensor-parallel rank keeps its slice); the references come as one
    of:
    - tensor_handles: our JSON form (TensorHandles; nothing is unpickled), one set that every
      rank opens, or a list of one set per rank, in rank order (e.g. each on that rank's GPU);
    - serialized_named_tensors: SGLang's, base64 pickles of torch's ForkingPickler, one per
      rank (or one for all), opened through a restricted unpickler (serialized_tensors.py)."""

    method: ClassVar[str] = "update_weights_from_tensor"
    # TensorHandles or their JSON form (checked field by field), or a list of them per rank.
    tensor_handles: TensorHandles | tuple[TensorHandles, ...] | None = None
    load_format: str | None = None
    flush_cache: bool = True
    weight_version: str | None = None
    serialized_named_tensors: tuple[str, ...] | None = None  # held as base64 text
    abort_all_requests: bool = False  # end every request in flight first (SGLang's meaning)
    # The loaded LoRA adapter whose values these are (PEFT names): see adapter_update.py.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        _lora_name(self.lora_name)
        handles, serialized = self.tensor_handles, self.serialized_named_tensors
        if (handles is None) == (serialized is None):
            raise InvalidRequest(
                "give exactly one of tensor_handles and serialized_named_tensors"
            )
        if serialized is not None:
            if isinstance(serialized, (str, bytes)) or not isinstance(serialized, (list, tuple)) or not serialized:
                raise InvalidRequestType(
                    "serialized_named_tensors must be a non-empty list, one payload per rank"
                )
            settle(self, "serialized_named_tensors", tuple(as_text(p) for p in serialized))
        elif isinstance(handles, (list, tuple)):
            if not handles:
                raise InvalidRequest("tensor_handles per rank must be a non-empty list")
            settle(self, "tensor_handles", tuple(handles_of(h) for h in handles))
        else:
            settle(self, "tensor_handles", handles_of(handles))
        check_tensor_format(self.load_format)
        _flush_cache(self.flush_cache)
        check_version(self.weight_version)
        check_bool(self.abort_all_requests, "abort_all_requests")

    def to_wire(self) -> dict[str, Any]:
        handles = self.tensor_handles
        if handles is None:
            return super().to_wire()
        wire = [h.to_json() for h in handles] if isinstance(handles, tuple) else handles.to_json()
        return {**super().to_wire(), "tensor_handles": wire}

    def handles_for(self, rank: int, size: int) -> TensorHandles:
        """The handles tensor-parallel rank `rank` of `size` opens."""
        return for_rank(self.tensor_handles, "tensor_handles", "sets of handles", rank, size)

    def payload_for(self, rank: int, size: int) -> str:
        """The serialized payload tensor-parallel rank `rank` of `size` opens."""
        payloads = self.serialized_named_tensors
        if payloads is not None and len(payloads) == 1:
            return payloads[0]
        return for_rank(payloads, "serialized_named_tensors", "payloads", rank, size)

    @classmethod
    @contextlib.contextmanager
    def shared(
        cls, named_tensors: NamedTensors, load_format: str | None = None,
        flush_cache: bool = True, weight_version: str | None = None,
        lora_name: str | None = None, abort_all_requests: bool = False,
    ) -> Iterator[UpdateWeightsFromTensor]:  # fmt: skip
        """The call for tensors of this process, shared here (as handles) until the block ends:
        send it and wait for the reply inside. TensorHandles shared by another process, and
        SGLang's serialized payloads (a list of base64 text or bytes, one per rank), are sent
        as they are; SGLang's {"flattened_tensor", "metadata"} bucket is shared as its
        tensors."""
        lora = {"lora_name": lora_name, "abort_all_requests": abort_all_requests}
        if isinstance(named_tensors, TensorHandles) or per_rank(named_tensors):
            yield cls(named_tensors, load_format, flush_cache, weight_version, **lora)
            return
        if serialized(named_tensors):
            yield cls(None, load_format, flush_cache, weight_version, tuple(named_tensors), **lora)
            return
        check_tensor_format(load_format)
        if load_format == "flattened_bucket" and sglang_bucket(named_tensors):
            buckets = named_tensors if isinstance(named_tensors, (list, tuple)) else [named_tensors]
            named_tensors, load_format = [p for b in buckets for p in bucket_pairs(b)], None
        sent = share_tensors(tensor_source(named_tensors, load_format))
        try:
            yield cls(sent.handles, load_format, flush_cache, weight_version, **lora)
        finally:
            sent.close()


@dataclass(frozen=True)
class UpdateWeightsFromDisk(ControlCall):
    """Reload a checkpoint directory of the same network (with lora_name: a PEFT adapter
    directory, replacing that loaded adapter). allowed_roots: None reads anywhere; otherwise
    every file opened (config, index, shards; symlinks followed) must resolve under one of
    these directories."""

    method: ClassVar[str] = "update_weights_from_disk"
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    allowed_roots: tuple[str, ...] | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False  # end every request in flight first (SGLang's meaning)
    # The loaded LoRA adapter to replace with the PEFT adapter directory model_path.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        _lora_name(self.lora_name)
        if not isinstance(self.model_path, str) or not self.model_path:
            raise InvalidRequest(
                f"model_path must be a checkpoint directory, got {self.model_path!r}"
            )
        disk_source.check_load_format(self.load_format)
        check_version(self.weight_version)
        _flush_cache(self.flush_cache)
        check_bool(self.abort_all_requests, "abort_all_requests")
        settle(self, "allowed_roots", _roots(self.allowed_roots))


def _roots(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InvalidRequestType(
            f"allowed_roots must be a list of directories or None, got {value!r:.100}"
        )
    if not all(isinstance(r, str) and r for r in value):
        raise InvalidRequest(
            f"allowed_roots must hold non-empty directory paths, got {value!r:.200}"
        )
    return tuple(value)


@dataclass(frozen=True)
class GetWeightsByName(ControlCall):
    """The first truncate_size rows of a weight (HF name), as float lists."""

    method: ClassVar[str] = "get_weights_by_name"
    name: str
    truncate_size: int = 100

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequest(f"name must be a weight's HF name, got {self.name!r}")
        if not is_int(self.truncate_size) or self.truncate_size < 1:
            raise InvalidRequest(f"truncate_size must be an int >= 1, got {self.truncate_size!r}")


@dataclass(frozen=True)
class GetWeightVersion(ControlCall):
    """The version label the outputs carry now."""

    method: ClassVar[str] = "get_weight_version"


@dataclass(frozen=True)
class UpdateWeightVersion(ControlCall):
    """Publish new_version: staged updates commit under it; otherwise a relabel."""

    method: ClassVar[str] = "update_weight_version"
    new_version: str
    abort_all_requests: bool = False

    def __post_init__(self) -> None:
        if check_version(self.new_version, "new_version") is None:
            raise InvalidRequest("new_version must be a non-empty string, got None")
        check_bool(self.abort_all_requests, "abort_all_requests")


@dataclass(frozen=True)
class PauseGeneration(ControlCall):
    """Stop stepping until continue_generation. abort: requests in flight end; retract: they
    re-queue and re-prefill later; in_place: they keep their KV. Updates meanwhile are staged."""

    method: ClassVar[str] = "pause_generation"
    mode: str = "abort"

    def __post_init__(self) -> None:
        if self.mode not in PAUSE_MODES:
            raise InvalidRequest(f"mode must be one of {', '.join(PAUSE_MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class ContinueGeneration(ControlCall):
    """Step again after pause_generation; the updates staged meanwhile commit first, all
    together, under the last version they named."""

    method: ClassVar[str] = "continue_generation"


@dataclass(frozen=True)
class DiscardStagedWeights(ControlCall):
    """Roll back every update staged since pause_generation (on every rank), leaving the
    weights and version as they were before it; nothing staged: nothing to do. For a caller
    that updates several engines together and must undo the ones that took an update when
    another refused it."""

    method: ClassVar[str] = "discard_staged_weights"


@dataclass(frozen=True)
class _MemoryCall(ControlCall):
    """A call on memory regions by tag: weights, kv_cache, cuda_graph (see memory.py)."""

    tags: tuple[str, ...] | None = None  # None: every tag; held as the tags to act on

    def __post_init__(self) -> None:
        settle(self, "tags", tuple(check_tags(self.tags)))


@dataclass(frozen=True)
class ReleaseMemoryOccupation(_MemoryCall):
    """Give back the memory of `tags` (requests in flight re-queue; new ones wait)."""

    method: ClassVar[str] = "release_memory_occupation"


@dataclass(frozen=True)
class ResumeMemoryOccupation(_MemoryCall):
    """Take the memory of `tags` back; weights released without a copy must be pushed again
    before generation continues."""

    method: ClassVar[str] = "resume_memory_occupation"


WEIGHT_CALLS: tuple[type[ControlCall], ...] = (
    InitWeightsUpdateGroup, DestroyWeightsUpdateGroup, UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor, UpdateWeightsFromDisk, GetWeightsByName, GetWeightVersion,
    UpdateWeightVersion, PauseGeneration, ContinueGeneration, DiscardStagedWeights,
    ReleaseMemoryOccupation, ResumeMemoryOccupation,
)  # fmt: skip
