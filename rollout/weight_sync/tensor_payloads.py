"""What `update_weights_from_tensor` takes, and its checks: (name, tensor) pairs or a dict,
FlatBuckets (load_format "flattened_bucket"), SGLang's {"flattened_tensor", "metadata"} bucket,
TensorHandles shared by another process (one set, or one per tensor-parallel rank), or SGLang's
serialized payloads (base64 text, one per rank)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rollout.errors import InvalidRequest, InvalidRequestType
from rollout.weight_sync.flat_bucket import FlatBucket
from rollout.weight_sync.tensor_handles import TensorHandles

# What update_weights_from_tensor takes: (name, tensor) pairs or a dict (load_format None), a
# FlatBucket or a list of them ("flattened_bucket"), or handles another process shared (one
# set, or a list of one set per tensor-parallel rank).
NamedTensors = (
    Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | FlatBucket
    | Sequence[FlatBucket] | TensorHandles | Sequence[TensorHandles]
)  # fmt: skip
Shareable = list[tuple[str, torch.Tensor]] | FlatBucket | list[FlatBucket]

TENSOR_LOAD_FORMATS = (None, "flattened_bucket")


def for_rank(given: Any, field: str, things: str, rank: int, size: int) -> Any:
    if not isinstance(given, tuple):
        return given
    if len(given) != size:
        raise InvalidRequest(
            f"{field} holds {len(given)} {things}, one per rank, but the engine has {size} "
            f"tensor-parallel rank(s): give {size}, or one for all"
        )
    return given[rank]


def serialized(value: Any) -> bool:
    """SGLang's per-rank payloads: a list of base64 text or bytes."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(p, (str, bytes, bytearray)) for p in value)
    )


def sglang_bucket(value: Any) -> bool:
    """SGLang's flattened bucket {"flattened_tensor", "metadata"}, or a list of them."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return bool(items) and all(isinstance(b, dict) and "flattened_tensor" in b for b in items)


def handles_of(value: Any) -> TensorHandles:
    if isinstance(value, dict):
        return TensorHandles.from_json(value)
    if not isinstance(value, TensorHandles):
        raise InvalidRequestType(
            f"tensor_handles must be TensorHandles or their JSON (or a list of them, one per "
            f"rank), got {type(value).__name__}"
        )
    return value


def per_rank(value: Any) -> bool:
    """A list of TensorHandles: one set per tensor-parallel rank, shared by their sender."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(h, TensorHandles) for h in value)
    )


def check_tensor_format(load_format: Any) -> None:
    if load_format not in TENSOR_LOAD_FORMATS:
        raise InvalidRequest(f"load_format must be None or flattened_bucket, got {load_format!r}")


def tensor_source(named_tensors: NamedTensors, load_format: str | None) -> Shareable:
    if load_format == "flattened_bucket":
        if isinstance(named_tensors, FlatBucket):
            return named_tensors
        if (
            isinstance(named_tensors, (list, tuple))
            and named_tensors
            and all(isinstance(b, FlatBucket) for b in named_tensors)
        ):
            return list(named_tensors)
        raise InvalidRequestType(
            "with load_format='flattened_bucket', give a FlatBucket or a list of them"
        )
    pairs = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else named_tensors
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise InvalidRequestType(
            "named_tensors must be a non-empty list of (name, tensor) pairs or a dict"
        )
    for pair in pairs:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
                and isinstance(pair[1], torch.Tensor)):  # fmt: skip
            raise InvalidRequestType(
                f"named_tensors entries must be (str, torch.Tensor), got {pair!r:.80}"
            )
    return [tuple(p) for p in pairs]
