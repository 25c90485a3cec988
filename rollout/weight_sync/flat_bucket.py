"""FlatBucket: many named tensors packed back to back in one byte buffer.

One buffer means one CUDA IPC handle, one shared-memory block or one broadcast for many
tensors. Each tensor starts at an aligned offset, so its view is an ordinary aligned tensor of
its own dtype. A sender keeps its buckets between steps: reopening an IPC handle is the slow
part of a handoff, and the same buffer keeps the same handle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout.weight_sync.shared_memory import SharedBlock
from rollout.weight_sync.specs import WeightSpec, check_unique

ALIGN = 256  # bytes; a multiple of every dtype's size, and what CUDA allocations give


@dataclass(frozen=True)
class BucketEntry:
    spec: WeightSpec
    offset: int  # bytes from the start of the buffer

    @property
    def end(self) -> int:
        return self.offset + self.spec.nbytes


def layout(specs: Sequence[WeightSpec]) -> tuple[list[BucketEntry], int]:
    """Aligned offsets for `specs` in order, and the buffer size they need."""
    check_unique([s.name for s in specs])
    entries, pos = [], 0
    for spec in specs:
        entries.append(BucketEntry(spec, pos))
        pos = -(-(pos + spec.nbytes) // ALIGN) * ALIGN
    return entries, pos


class FlatBucket:
    def __init__(self, buffer: torch.Tensor, entries: list[BucketEntry], block: SharedBlock | None = None) -> None:
        """buffer: [nbytes] uint8, contiguous; entries must lie inside it, aligned."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
            raise ValueError(f"a bucket buffer must be a contiguous 1-D uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
        for e in entries:
            if e.offset % e.spec.dtype.itemsize or e.end > buffer.numel():
                raise ValueError(f"{e.spec.name} at byte {e.offset} does not fit a {buffer.numel()}-byte bucket")
        self.buffer = buffer
        self.entries = entries
        self.block = block  # set when the buffer is a host shared-memory block
        self._views: list[torch.Tensor] | None = None  # each entry's view, made on first use

    @classmethod
    def allocate(cls, specs: Sequence[WeightSpec], device: torch.device | str, shared: bool = True) -> FlatBucket:
        """An empty bucket for `specs` on `device`. On the host with `shared`, the buffer is a
        shared-memory block, so a handoff needs no copy."""
        entries, nbytes = layout(specs)
        if torch.device(device).type == "cpu" and shared:
            block = SharedBlock(nbytes)
            return cls(block.tensor, entries, block)
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device), entries)

    @classmethod
    def allocate_raw(cls, nbytes: int, device: torch.device | str) -> FlatBucket:
        """A buffer with no tensors yet: carve buckets out of it with `FlatBucket(buffer[:n],
        entries, block)`, all sharing its one handle."""
        if torch.device(device).type == "cpu":
            block = SharedBlock(nbytes)
            return cls(block.tensor, [], block)
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device), [])

    @classmethod
    def pack(
        cls, named: Sequence[tuple[str, torch.Tensor]], device: torch.device | str | None = None,
        shared: bool = True,
    ) -> FlatBucket:  # fmt: skip
        """A new bucket holding copies of `named` (on `device`, default the first tensor's;
        `shared` as for `allocate`)."""
        if not named:
            raise ValueError("a bucket needs at least one tensor, got none")
        specs = [WeightSpec(n, tuple(t.shape), t.dtype) for n, t in named]
        bucket = cls.allocate(specs, device or named[0][1].device, shared)
        bucket.fill(named)
        return bucket

    @property
    def specs(self) -> list[WeightSpec]:
        return [e.spec for e in self.entries]

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def view(self, entry: BucketEntry) -> torch.Tensor:
        raw = self.buffer[entry.offset : entry.end]
        return raw.view(entry.spec.dtype).view(entry.spec.shape)

    def views(self) -> list[tuple[str, torch.Tensor]]:
        return [(e.spec.name, view) for e, view in zip(self.entries, self._entry_views())]

    def _entry_views(self) -> list[torch.Tensor]:
        if self._views is None:
            self._views = [self.view(e) for e in self.entries]
        return self._views

    @torch.no_grad()
    def fill(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Copies each tensor (cast to its entry's dtype) into its place, all in one batched
        copy; names must be exactly the bucket's."""
        given = dict(named)
        if len(given) != len(named) or given.keys() != {e.spec.name for e in self.entries}:
            raise ValueError("fill needs exactly the bucket's tensor names, once each")
        sources = [given[e.spec.name] for e in self.entries]
        for entry, src in zip(self.entries, sources):
            if src.shape != entry.spec.shape:
                raise ValueError(f"{entry.spec.name} must be {list(entry.spec.shape)}, got {list(src.shape)}")
        if sources:
            torch._foreach_copy_(self._entry_views(), sources, non_blocking=True)

    def close(self) -> None:
        """Frees a shared-memory buffer (a no-op for device buffers: they go with the object)."""
        if self.block is not None:
            self.block.close()
            self.block = None
            self.buffer = torch.empty(0, dtype=torch.uint8)
            self._views = None
