"""The broadcast wire format of `update_weights_from_distributed`, for both ends (SGLang's).

The trainer (rank 0) and the engine agree on the tensors from the call's names, dtypes and
shapes alone:
- load_format None: one broadcast per tensor, in call order, each of its own shape and dtype;
- load_format "flattened_bucket": one broadcast for the whole call: a 1-D uint8 tensor holding
  every tensor's bytes back to back in call order, with no padding (SGLang's
  FlattenedTensorBucket; for a call of one dtype these are the same bytes as that dtype's
  tensors concatenated). Fewer, larger broadcasts for many small tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from rollout.errors import InvalidRequest
from rollout.weight_sync.specs import WeightSpec
from rollout.weight_sync.update_group import UpdateGroup

LOAD_FORMATS = (None, "flattened_bucket")


def check_load_format(load_format: object) -> None:
    if load_format not in LOAD_FORMATS:
        raise InvalidRequest(
            f"load_format for a distributed update must be None or flattened_bucket, got {load_format!r}"
        )


def broadcast_units(specs: Sequence[WeightSpec], load_format: str | None) -> list[list[WeightSpec]]:
    """The broadcasts of one call, in order; each lists the tensors it carries."""
    if load_format is None:
        return [[s] for s in specs]
    return [list(specs)]


def _buffer(unit: list[WeightSpec], flat: bool, device: torch.device) -> torch.Tensor:
    if not flat:
        return torch.empty(unit[0].shape, dtype=unit[0].dtype, device=device)
    return torch.empty(sum(s.nbytes for s in unit), dtype=torch.uint8, device=device)


def receive(
    group: UpdateGroup, units: list[list[WeightSpec]], load_format: str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: yields each tensor as its broadcast arrives (raising WeightSyncError if the
    trainer fails midway). Each broadcast gets a fresh buffer, never a parameter, so a late or
    partial write can't touch the model."""
    flat = load_format == "flattened_bucket"
    for unit in units:
        buffer = _buffer(unit, flat, group.device)
        group.broadcast(buffer, f"receiving {unit[0].name}")
        if not flat:
            yield unit[0].name, buffer
            continue
        pos = 0
        for spec in unit:
            raw = buffer[pos : pos + spec.nbytes]
            # A byte offset need not suit the dtype's alignment: such a tensor is copied out.
            aligned = pos % spec.dtype.itemsize == 0
            yield spec.name, (raw if aligned else raw.clone()).view(spec.dtype).view(spec.shape)
            pos += spec.nbytes


def drain(group: UpdateGroup, units: list[list[WeightSpec]], load_format: str | None) -> None:
    """Engine side, for a refused update: takes the trainer's broadcasts and drops them, so the
    trainer finishes its call and the group stays usable."""
    for _ in receive(group, units, load_format):
        pass


def flatten(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The flattened_bucket payload: every tensor's bytes back to back, as 1-D uint8."""
    return torch.cat([t.to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def send(group: UpdateGroup, named: Sequence[tuple[str, torch.Tensor]], load_format: str | None) -> None:
    """Trainer side: broadcasts `named` (already in the engine's dtype) in the agreed order."""
    if load_format == "flattened_bucket":
        group.broadcast(flatten([t for _, t in named], group.device), f"sending {named[0][0]}")
        return
    for name, tensor in named:
        group.broadcast(tensor.to(group.device).contiguous(), f"sending {name}")
