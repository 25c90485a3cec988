"""The weight-sync calls as control messages, shared by RolloutEngine and an HTTP server/client.

Each function checks its arguments where the caller is (TypeError/ValueError before anything is
sent) and returns a WeightCall: the scheduler method, its keyword arguments (plain data), and
anything the caller must keep alive until the reply (the tensors a handoff points at). The
scheduler answers {"success": bool, "message": str, ...}; `unwrap` turns a failure into
ValueError (the update did not fit the model), PermissionError (a checkpoint file outside the
allowed weight roots) or WeightSyncError (the transfer failed); either way the weights and
version are as before unless the message says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.weight_sync import disk_source, distributed_source
from rollout.weight_sync.flat_bucket import FlatBucket
from rollout.weight_sync.memory import check_tags
from rollout.weight_sync.specs import build_specs, dtype_name
from rollout.weight_sync.tensor_handles import SentTensors, TensorHandles, share_tensors
from rollout.weight_sync.update_group import BACKENDS, WeightSyncError, check_group_args
from rollout.weight_sync.versions import check_version

DEFAULT_GROUP = "weight_update_group"
PAUSE_MODES = ("abort", "retract", "in_place")
TENSOR_LOAD_FORMATS = (None, "flattened_bucket")


@dataclass
class WeightCall:
    method: str
    kwargs: dict[str, Any]
    keep: SentTensors | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.keep is not None:
            self.keep.close()


def unwrap(result: dict[str, Any]) -> dict[str, Any]:
    """The result of a successful call; raises the failure of a failed one."""
    if result.get("success"):
        return result
    kinds = {
        "ValueError": ValueError, "TypeError": TypeError, "KeyError": ValueError,
        "PermissionError": PermissionError,  # a file outside the allowed weight roots
    }  # fmt: skip
    kind = kinds.get(result.get("error", ""), WeightSyncError)
    raise kind(result.get("message") or "the weight-sync call failed")


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {value!r}")
    return float(value)


def init_weights_update_group(
    master_address: str, master_port: int, rank_offset: int, world_size: int,
    group_name: str = DEFAULT_GROUP, backend: str = "nccl", timeout_s: float | None = None,
) -> WeightCall:  # fmt: skip
    if not isinstance(rank_offset, int) or isinstance(rank_offset, bool) or rank_offset < 1:
        raise ValueError(f"rank_offset must be an int >= 1 (the trainer is rank 0), got {rank_offset!r}")
    check_group_args(master_address, master_port, rank_offset, world_size, group_name, backend)
    kwargs = dict(
        master_address=master_address, master_port=master_port, rank_offset=rank_offset,
        world_size=world_size, group_name=group_name, backend=backend, timeout_s=_timeout(timeout_s),
    )  # fmt: skip
    return WeightCall("init_weights_update_group", kwargs)


def destroy_weights_update_group(group_name: str = DEFAULT_GROUP) -> WeightCall:
    if not isinstance(group_name, str) or not group_name:
        raise ValueError(f"group_name must be a non-empty string, got {group_name!r}")
    return WeightCall("destroy_weights_update_group", {"group_name": group_name})


def update_weights_from_distributed(
    names: Sequence[str], dtypes: Sequence[Any], shapes: Sequence[Sequence[int]],
    group_name: str = DEFAULT_GROUP, flush_cache: bool = True, weight_version: str | None = None,
    load_format: str | None = None,
) -> WeightCall:  # fmt: skip
    specs = build_specs(list(names), list(dtypes), list(shapes))
    distributed_source.check_load_format(load_format)
    kwargs = dict(
        names=[s.name for s in specs], dtypes=[dtype_name(s.dtype) for s in specs],
        shapes=[list(s.shape) for s in specs], group_name=group_name,
        flush_cache=_bool(flush_cache, "flush_cache"), weight_version=check_version(weight_version),
        load_format=load_format,
    )  # fmt: skip
    return WeightCall("update_weights_from_distributed", kwargs)


def update_weights_from_tensor(
    named_tensors: Any, load_format: str | None = None, flush_cache: bool = True,
    weight_version: str | None = None,
) -> WeightCall:  # fmt: skip
    """named_tensors: a list of (name, tensor) or a dict (load_format None), a FlatBucket or a
    list of them ("flattened_bucket"), or TensorHandles already shared by another process."""
    if load_format not in TENSOR_LOAD_FORMATS:
        raise ValueError(f"load_format must be None or flattened_bucket, got {load_format!r}")
    _bool(flush_cache, "flush_cache")
    version = check_version(weight_version)
    keep = None
    if isinstance(named_tensors, TensorHandles):
        handles = named_tensors
    else:
        keep = share_tensors(_tensor_source(named_tensors, load_format))
        try:
            handles = TensorHandles.from_json(keep.handles.to_json())  # what the receiver checks
        except (ValueError, TypeError):
            keep.close()
            raise
    kwargs = {"handles": handles.to_json(), "flush_cache": flush_cache, "weight_version": version}
    return WeightCall("update_weights_from_tensor", kwargs, keep)


def _tensor_source(named_tensors: Any, load_format: str | None) -> Any:
    if load_format == "flattened_bucket":
        if isinstance(named_tensors, FlatBucket):
            return named_tensors
        if isinstance(named_tensors, (list, tuple)) and named_tensors and all(
            isinstance(b, FlatBucket) for b in named_tensors
        ):
            return list(named_tensors)
        raise TypeError("with load_format='flattened_bucket', give a FlatBucket or a list of them")
    pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else named_tensors
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise TypeError("named_tensors must be a non-empty list of (name, tensor) pairs or a dict")
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):  # fmt: skip
            raise TypeError(f"named_tensors entries must be (str, torch.Tensor), got {pair!r:.80}")
    return [tuple(p) for p in pairs]


def update_weights_from_disk(
    model_path: str, load_format: str | None = None, weight_version: str | None = None,
    allowed_roots: Sequence[str] | None = None,
) -> WeightCall:  # fmt: skip
    """allowed_roots: None reads anywhere; otherwise every file the scheduler opens (config,
    index, shards; symlinks followed) must resolve under one of these directories."""
    if not isinstance(model_path, str) or not model_path:
        raise ValueError(f"model_path must be a checkpoint directory, got {model_path!r}")
    disk_source.check_load_format(load_format)
    kwargs = {
        "model_path": model_path, "load_format": load_format,
        "weight_version": check_version(weight_version), "allowed_roots": _roots(allowed_roots),
    }  # fmt: skip
    return WeightCall("update_weights_from_disk", kwargs)


def _roots(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TypeError(f"allowed_roots must be a list of directories or None, got {value!r:.100}")
    if not all(isinstance(r, str) and r for r in value):
        raise ValueError(f"allowed_roots must hold non-empty directory paths, got {value!r:.200}")
    return list(value)


def get_weights_by_name(name: str, truncate_size: int = 100) -> WeightCall:
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a weight's HF name, got {name!r}")
    if not isinstance(truncate_size, int) or isinstance(truncate_size, bool) or truncate_size < 1:
        raise ValueError(f"truncate_size must be an int >= 1, got {truncate_size!r}")
    return WeightCall("get_weights_by_name", {"name": name, "truncate_size": truncate_size})


def update_weight_version(new_version: str, abort_all_requests: bool = False) -> WeightCall:
    if check_version(new_version, "new_version") is None:
        raise ValueError("new_version must be a non-empty string, got None")
    kwargs = {"new_version": new_version, "abort_all_requests": _bool(abort_all_requests, "abort_all_requests")}
    return WeightCall("update_weight_version", kwargs)


def pause_generation(mode: str = "abort") -> WeightCall:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return WeightCall("pause_generation", {"mode": mode})


def release_memory_occupation(tags: list[str] | None = None) -> WeightCall:
    return WeightCall("release_memory_occupation", {"tags": check_tags(tags)})


def resume_memory_occupation(tags: list[str] | None = None) -> WeightCall:
    return WeightCall("resume_memory_occupation", {"tags": check_tags(tags)})


__all__ = ["BACKENDS", "DEFAULT_GROUP", "WeightCall", "WeightSyncError", "unwrap"]
