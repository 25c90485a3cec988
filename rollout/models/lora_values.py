"""ValueWrites: where each tensor of an adapter's update lands in its slot, worked out once.

A trainer pushes the same tensors step after step: the names and shapes stay, the values
change. The update's check (AdapterSlots.check_values) and the slot view each tensor is copied
into depend only on those names and shapes and on the adapter as loaded, so AdapterSlots keeps
the last ValueWrites of each adapter, reuses it while the names and shapes repeat, and drops it
when the adapter is loaded again or unloaded. A write is then one batched copy
(torch._foreach_copy_, which casts to the slot's dtype) rather than Python and several ops per
tensor: on a GPU, a few launches for the whole adapter instead of several per tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.forward.tensor_parallel import Shard

# (PEFT name, shape) of each tensor of an update, in the order it comes.
ValueKey = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class ValueWrites:
    """The checked layout of one update of an adapter: for its i-th tensor, the slot view it
    is copied into (A [rank, in] or B [out, rank], this rank's slice) and the slice of the full
    tensor this rank keeps."""

    key: ValueKey
    targets: list[torch.Tensor]  # views of the slot buffers, one per tensor
    shards: list[Shard | None]  # this rank's slice of each full tensor (None: all of it)
    modules: int  # how many modules the update changes

    @torch.no_grad()
    def write(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copies `tensors` (the update's, in `key`'s order, shapes checked) into the slot."""
        sources = [t if s is None else s.take(t) for t, s in zip(tensors, self.shards)]
        # _foreach_copy_ copies a whole list in a few launches only when every pair is dense
        # and laid out alike (else it copies one pair at a time): a slot's B past a rank below
        # max_lora_rank, or a slice of a full tensor, is not, so those pairs go apart.
        dense, strided = [], []
        for target, source in zip(self.targets, sources):
            alike = target.is_contiguous() and source.is_contiguous()
            (dense if alike else strided).append((target, source))
        for pairs in (dense, strided):
            if pairs:
                torch._foreach_copy_([t for t, _ in pairs], [s for _, s in pairs])
