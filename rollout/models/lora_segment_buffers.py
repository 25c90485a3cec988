"""The persistent device buffer a LoRA batch's kernels read, written from the host in one copy.

Each forward's rows (their adapter slots) and the segments the kernels read them through
(rollout_kernels.lora_segments: the rows sorted by slot, each slot's start and length, and the
per-block tables) live side by side in one int32 device buffer, with views for a batch of any
number of rows up to `max_tokens`. The runner knows each row's slot on the host, so the
layout is computed there (numpy, a few microseconds for a decode batch) and reaches the device
as one copy, instead of the thirty-odd small device ops of building it with torch (a sort,
scatters, prefix sums, gathers) ahead of every step. A CUDA graph captured over the views
replays whatever a later copy wrote.
"""

from __future__ import annotations

import numpy as np
import torch

from rollout.models.layers import kernel

ALIGN_INTS = 4  # int32s in 16 bytes


def host_layout(slots: np.ndarray, num_slots: int, block_m: int, blocks: int) -> list[np.ndarray]:
    """What lora_segments computes on the device, for host slots: order, seg_start, seg_len,
    block_end and the block tables (slot, first, rows) of `blocks` program blocks."""
    key = np.where((slots < 0) | (slots >= num_slots), num_slots, slots)
    order = np.argsort(key, kind="stable")
    seg_len = np.bincount(key, minlength=num_slots + 1)[:num_slots]
    seg_start = np.cumsum(seg_len) - seg_len
    per_slot = (seg_len + block_m - 1) // block_m
    block_end = np.cumsum(per_slot)
    b = np.arange(blocks)
    slot = np.searchsorted(block_end, b, side="right")
    safe = np.minimum(slot, num_slots - 1)
    local = b - (block_end - per_slot)[safe]
    rows = np.where(slot < num_slots, np.clip(seg_len[safe] - local * block_m, 0, block_m), 0)
    first = seg_start[safe] + local * block_m
    return [order, seg_start, seg_len, block_end, slot, first, rows]


class SegmentBuffers:
    """Slots and segments of up to `max_tokens` rows over `num_slots` adapter slots, in blocks
    of `block_m` rows: one int32 buffer on the device and its host mirror, written from the
    host (`write`, `pad`) and copied whole."""

    def __init__(
        self, max_tokens: int, num_slots: int, device: torch.device | str, block_m: int
    ) -> None:
        segments = kernel("lora_segments")
        self.num_slots, self.block_m = num_slots, block_m
        g = segments.grid_blocks(max_tokens, num_slots, block_m)
        sizes = [max_tokens, max_tokens, num_slots, num_slots, num_slots, g, g, g]
        # NOTE: every part starts at a multiple of 16 bytes into the buffer: Triton
        # specializes a pointer argument on that alignment, and a part whose start moved with
        # max_tokens would compile a second variant for a buffer of another size (a long
        # prefill's) than the warm-up's.
        spans = [-(-size // ALIGN_INTS) * ALIGN_INTS for size in sizes]
        self.device = torch.full((sum(spans),), -1, dtype=torch.int32, device=device)
        self.host = torch.full((sum(spans),), -1, dtype=torch.int32)
        dev = [part[:size] for part, size in zip(torch.split(self.device, spans), sizes)]
        host = [part[:size].numpy() for part, size in zip(torch.split(self.host, spans), sizes)]
        self.slots = dev[0]  # [max_tokens]: each row's slot (-1 base only)
        self._host_slots, self._host_parts = host[0], host[1:]
        self._device_segments = segments.LoraSegments(*dev[1:], block_m=block_m)
        self._grid_blocks = segments.grid_blocks
        self.num_rows = 0  # rows of the batch last written (padding included)

    def segments(self, t: int):
        """LoraSegments views of the device buffer for a batch of t rows."""
        return self._device_segments.rows(t)

    def write(self, token_slots: np.ndarray) -> None:
        """Lays out a batch of these slots (host ints, at most max_tokens) on the host and
        copies the buffer to the device (stream-ordered: a step still running reads what it
        was given)."""
        t = len(token_slots)
        self._host_slots[:t] = token_slots
        layout = host_layout(self._host_slots[:t], self.num_slots, self.block_m, self._blocks(t))
        for view, values in zip(self._host_views(t), layout):
            view[:] = values
        self.num_rows = t
        self._copy()

    def pad(self, rows: int) -> None:
        """Extends the last batch written (t rows) to `rows` with base-only padding rows: the
        layout a batch of those t rows and rows - t rows of -1 would have."""
        t = self.num_rows
        g_t = self._blocks(t)
        order, _, _, _, block_slot, block_first, block_rows = self._host_views(rows)
        self._host_slots[t:rows] = -1
        order[t:rows] = np.arange(t, rows)  # base-only rows sort last, in row order
        block_slot[g_t:] = self.num_slots  # blocks past the last slot's: empty
        block_first[g_t:] = 0
        block_rows[g_t:] = 0
        self.num_rows = rows
        self._copy()

    def _blocks(self, t: int) -> int:
        return self._grid_blocks(t, self.num_slots, self.block_m)

    def _host_views(self, t: int) -> tuple[np.ndarray, ...]:
        """The host mirror's seven segment parts for a batch of t rows, in LoraSegments' field
        order (numpy views, as LoraSegments.rows slices the device ones): a step's layout runs
        no torch op."""
        order, seg_start, seg_len, block_end, *tables = self._host_parts
        g = self._blocks(t)
        return (order[:t], seg_start, seg_len, block_end, *(table[:g] for table in tables))

    def _copy(self) -> None:
        # NOTE: from pageable memory, CUDA stages the source before the call returns: the
        # host buffer may be rewritten for the next step at once.
        self.device.copy_(self.host, non_blocking=True)
