"""The broadcast wire format of `update_weights_from_distributed`, for both ends.

The trainer (rank 0) and the engine agree on the tensors from the call's names, dtypes and
shapes alone:
- load_format None: one broadcast per tensor, in call order, each of its own shape and dtype;
- load_format "flattened_bucket": one broadcast per dtype, in order of the dtype's first
  appearance: a 1-D tensor of that dtype holding its tensors flattened back to back in call
  order. Fewer, larger broadcasts for many small tensors.
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
    by_dtype: dict[torch.dtype, list[WeightSpec]] = {}
    for spec in specs:
        by_dtype.setdefault(spec.dtype, []).append(spec)
    return list(by_dtype.values())


def _buffer(unit: list[WeightSpec], device: torch.device) -> torch.Tensor:
    if len(unit) == 1:
        return torch.empty(unit[0].shape, dtype=unit[0].dtype, device=device)
    return torch.empty(sum(s.numel for s in unit), dtype=unit[0].dtype, device=device)


def receive(group: UpdateGroup, units: list[list[WeightSpec]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: yields each tensor as its broadcast arrives (raising WeightSyncError if the
    trainer fails midway). Each broadcast gets a fresh buffer, never a parameter, so a late or
    partial write can't touch the model."""
    for unit in units:
        flat = _buffer(unit, group.device)
        group.broadcast(flat, f"receiving {unit[0].name}")
        if len(unit) == 1:
            yield unit[0].name, flat
            continue
        pos = 0
        for spec in unit:
            yield spec.name, flat[pos : pos + spec.numel].view(spec.shape)
            pos += spec.numel


def drain(group: UpdateGroup, units: list[list[WeightSpec]]) -> None:
    """Engine side, for a refused update: takes the trainer's broadcasts and drops them, so the
    trainer finishes its call and the group stays usable."""
    for _ in receive(group, units):
        pass


def send(group: UpdateGroup, named: Sequence[tuple[str, torch.Tensor]], load_format: str | None) -> None:
    """Trainer side: broadcasts `named` (already in the engine's dtype) in the agreed order."""
    specs = [WeightSpec(n, tuple(t.shape), t.dtype) for n, t in named]
    tensors = dict(named)
    for unit in broadcast_units(specs, load_format):
        if len(unit) == 1:
            payload = tensors[unit[0].name].to(group.device).contiguous()
        else:
            payload = torch.cat([tensors[s.name].reshape(-1).to(group.device) for s in unit])
        group.broadcast(payload, f"sending {unit[0].name}")
