"""Tensor parallelism: the group of ranks one model is split over, and which slice each holds.

A model built with a TPGroup of size k keeps about 1/k of its weights on each rank (see
rollout.models.layers and rollout.models.vocab_parallel): a layer whose output features are
split (column-parallel: fused QKV, gate/up) needs no communication; a layer whose input
features are split (row-parallel: o_proj, down_proj) sums its partial outputs over the group
with `all_reduce`; the vocabulary-parallel LM head gathers each rank's columns of the logits
with `all_gather`.

At size 1 every collective returns its input untouched, so a single-device model runs exactly
the ops it ran before. At size > 1 the collectives are plain torch.distributed calls on the
group (NCCL on GPU, gloo on CPU): a CUDA graph captures them with the rest of the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Newer torch renames all_gather_into_tensor; the call is the same.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Shard:
    """The slice [start, stop) along `dim` of a full (checkpoint-shaped) tensor of `full` rows
    there, that one rank holds. A rank that holds the whole tensor has no Shard (None)."""

    dim: int
    start: int
    stop: int
    full: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's view of the full `tensor` (no copy)."""
        return tensor.narrow(self.dim, self.start, self.size)

    def index(self) -> tuple[slice, ...]:
        """The same slice as an index, for readers that slice lazily (safetensors get_slice)."""
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: `rank` of `size`, communicating over
    `group` (a torch.distributed ProcessGroup; None means the default group)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(
                f"tensor-parallel rank must be in [0, size) with size >= 1, got rank "
                f"{self.rank} of size {self.size}"
            )

    @classmethod
    def single(cls) -> TPGroup:
        """Rank 0 of 1: no communication at all."""
        return SINGLE

    @classmethod
    def from_group(cls, group: dist.ProcessGroup | None = None) -> TPGroup:
        """This process's rank and size in `group` (None: the default group), once
        torch.distributed is initialised."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the group in place and returns it (every rank gets the same sum)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (all the same shape) concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x, group=self.group)
        dim = dim % x.dim()
        if dim == 0:
            return out
        # [size, *x.shape] with the rank axis moved next to `dim`, then merged into it.
        shape = (*x.shape[:dim], self.size * x.shape[dim], *x.shape[dim + 1 :])
        return out.view(self.size, *x.shape).movedim(0, dim).reshape(shape)

    def even_range(self, total: int, what: str) -> tuple[int, int]:
        """[start, stop) of this rank's equal part of `total` items; `what` names them in the
        ValueError raised when `total` does not split evenly."""
        if total % self.size:
            raise ValueError(
                f"{what} ({total}) must be divisible by the tensor-parallel size {self.size}"
            )
        part = total // self.size
        return self.rank * part, (self.rank + 1) * part

    def padded_range(self, total: int) -> tuple[int, int, int]:
        """(start, stop, rows) of this rank's part of `total` rows split in parts of
        ceil(total / size): the last parts may hold fewer than `rows` real rows (or none);
        a rank allocates `rows` so that every rank's part has the same shape."""
        rows = -(-total // self.size)
        start = min(self.rank * rows, total)
        return start, min(start + rows, total), rows

    def kv_head_range(self, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """[start, stop) of the KV heads this rank keeps. With at least as many KV heads as
        ranks they are split evenly; with fewer, each rank keeps the one KV head its query
        heads attend with (KV heads are then replicated size / num_kv_heads times)."""
        self.even_range(num_heads, "num_attention_heads")
        if num_kv_heads >= self.size:
            return self.even_range(num_kv_heads, "num_key_value_heads")
        if self.size % num_kv_heads:
            raise ValueError(
                f"with fewer KV heads ({num_kv_heads}) than tensor-parallel ranks "
                f"({self.size}), the size must be a multiple of num_key_value_heads"
            )
        head = self.rank * num_kv_heads // self.size
        return head, head + 1


# The default of every `tp` argument: a model built without one is the whole model.
SINGLE = TPGroup()


def make_shard(dim: int, start: int, stop: int, total: int) -> Shard | None:
    """The Shard for rows [start, stop) of `total` along `dim`, or None when they are all of them."""
    return None if (start, stop) == (0, total) else Shard(dim, start, stop, total)
