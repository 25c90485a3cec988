"""Where each checkpoint (HF) tensor lives in a model: its parameter, its rows inside a fused
parameter, and the slice of it this tensor-parallel rank holds.

Names and shapes seen from outside are always the checkpoint's: a trainer sends full tensors
by their HF names, whatever the engine's tensor-parallel size. The HFTarget of a name is the
one place that says which part of the full tensor lands where on this rank; weight loading,
reading weights back, and the checkpoint loader all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rollout.forward.tensor_parallel import Shard
from rollout.models.layers import MergedLinear


@dataclass(frozen=True)
class HFTarget:
    param: str  # our parameter
    rows: tuple[int, int] | None  # (first row, rows) inside a fused parameter; None: all of it
    shard: Shard | None  # this rank's slice of the HF tensor; None: the whole tensor
    shape: tuple[int, ...]  # the full HF tensor's shape


def map_hf_names(model: nn.Module) -> dict[str, HFTarget]:
    """HF name -> HFTarget for every parameter of `model`. Modules split over tensor-parallel
    ranks say how: MergedLinear by `part_shards` (per checkpoint projection), the others by an
    `hf_shards` dict of parameter name -> Shard or None."""
    targets = {}
    for module_name, module in model.named_modules():
        for kind, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{kind}"
            if not isinstance(module, MergedLinear):
                shard = getattr(module, "hf_shards", {}).get(kind)
                targets[name] = _target(name, param, None, shard)
                continue
            parent = module_name.rpartition(".")[0]
            for part, rows in module.part_rows().items():
                shard = module.part_shards[part]
                targets[f"{parent}.{part}.{kind}"] = _target(name, param, rows, shard)
    return targets


def _target(
    name: str, param: torch.Tensor, rows: tuple[int, int] | None, shard: Shard | None
) -> HFTarget:
    shape = list(param.shape)
    if rows is not None:
        shape[0] = rows[1]
    if shard is not None:
        shape[shard.dim] = shard.full
    return HFTarget(name, rows, shard, tuple(shape))


def target_view(param: torch.Tensor, target: HFTarget) -> torch.Tensor:
    """The live view of `target`'s values in `param` (its rows, without vocabulary padding)."""
    dest = param.data
    if target.rows is not None:
        start, rows = target.rows
        dest = dest[start : start + rows]
    shard = target.shard
    if shard is not None and dest.shape[shard.dim] != shard.size:
        dest = dest.narrow(shard.dim, 0, shard.size)
    return dest
