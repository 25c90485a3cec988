"""The adapter slots of one linear layer, and the per-forward state every such layer reads.

A LoraLayer holds fixed-size A and B buffers for every slot of one linear layer of the model:
a projection group (the fused QKV, gate/up) or a single projection (o_proj, down_proj).
`apply` adds each token row's adapter delta to the layer's output, in place; rows of slot -1
(base only) are left alone. Everything a forward reads lives in buffers allocated once, so a
CUDA graph captured with LoRA replays any later mix of adapters.

Tensor parallelism: a column-parallel layer (QKV, gate/up) keeps A whole and this rank's rows
of B, and its delta is this rank's columns of the output. A row-parallel layer (o_proj,
down_proj) keeps this rank's input columns of A and B whole; its delta from this rank's slice
of the input is a partial sum, added before the layer's all-reduce, which sums it with the
base output's partials (x @ A^T is linear in the input slices).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from rollout.forward.tensor_parallel import Shard
from rollout.models.layers import kernel
from rollout.models.lora_segment_buffers import SegmentBuffers


class LoraBatch:
    """What every LoraLayer reads in one forward: the adapter slot of each token row (-1: base
    only) and the rank of each slot. Set by the model runner before each forward (`prepare`).

    Buffers for up to `max_tokens` rows are allocated once and rewritten in place, so that a
    CUDA graph captured over them replays any later batch of as many rows; a larger batch
    (a long prefill, which runs eagerly) gets fresh ones for its forward. On the kernels' path
    the rows and their segments share one buffer, laid out on the host and copied once a step
    (SegmentBuffers).
    """

    def __init__(
        self, num_slots: int, max_tokens: int, device: torch.device | str, use_kernels: bool
    ) -> None:
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.use_kernels = use_kernels  # the Triton kernels, else torch ops
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)  # [S]
        self.live_slots: tuple[int, ...] = ()  # slots holding an adapter (host copy)
        if use_kernels:  # a decode batch's blocks, whatever max_tokens is
            block_m = kernel("lora_segments").BLOCK_M
            self._buffers = SegmentBuffers(max_tokens, num_slots, device, block_m)
            self._slots = self._buffers.slots
        else:
            self._slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.slots = self._slots[:0]  # [T]: this forward's rows
        self.segments = None  # this forward's LoraSegments (kernel path)
        self.active = False  # False: no row of this forward uses an adapter; layers skip

    @property
    def max_tokens(self) -> int:
        """Rows the persistent buffers hold (the largest batch a CUDA graph may replay)."""
        return self._slots.shape[0]

    def prepare(self, token_slots: torch.Tensor, active: bool = True) -> None:
        """token_slots: [T] int, the slot of each row of the next forward (-1 base only), read
        on the host (a device tensor is copied there first). With `active` False the layers
        add nothing (the runner knows, on the host, that no row uses an adapter). A CUDA graph
        must be captured with `active` True: the layers it captures then run for every replay,
        whatever its rows use."""
        t = token_slots.shape[0]
        persistent = t <= self.max_tokens
        self.active = active
        if not self.use_kernels:
            slots = self._slots[:t] if persistent else self._slots.new_empty(t)
            self.slots = slots.copy_(token_slots, non_blocking=True)
            return
        buffers = self._buffers
        if not persistent:
            block_m = kernel("lora_segments").block_m_for(t)
            buffers = SegmentBuffers(t, self.num_slots, self.device, block_m)
        buffers.write(token_slots.cpu().numpy())
        self.slots, self.segments = buffers.slots[:t], buffers.segments(t)

    def pad_to(self, rows: int) -> None:
        """Extends the prepared batch of T rows to `rows` (T <= rows <= max_tokens) with
        base-only padding rows, in the persistent buffers: the layout a `prepare` of the T
        rows followed by rows - T rows of -1 would give. A CUDA graph captured for `rows` rows
        replays it; the padding rows' outputs are discarded, and they add no delta."""
        t = self.slots.shape[0]
        persistent = self.slots.data_ptr() == self._slots.data_ptr()
        if not (persistent and t <= rows <= self.max_tokens):
            raise ValueError(
                f"pad_to({rows}) needs a batch prepared in the persistent buffers of "
                f"{self.max_tokens} rows with at most {rows} rows; it has {t}"
            )
        self.slots = self._slots[:rows]
        self.active = True
        if self.use_kernels:
            self._buffers.pad(rows)
            self.segments = self._buffers.segments(rows)
        else:
            self._slots[t:rows].fill_(-1)

    def prepare_requests(self, req_slots: Sequence[int], extend_lens: Sequence[int]) -> None:
        """The same from per-request slots and new-token counts (host lists, in batch order)."""
        rows = np.repeat(np.asarray(req_slots, dtype=np.int32), np.asarray(extend_lens))
        self.prepare(torch.from_numpy(rows), any(s >= 0 for s in req_slots))


class LoraLayer:
    """A and B of every adapter slot for one linear layer whose output is the projections
    `part_sizes` (this rank's output rows of each, in order) side by side."""

    def __init__(
        self,
        part_sizes: dict[str, int],
        in_features: int,
        max_rank: int,
        batch: LoraBatch,
        dtype: torch.dtype,
        device: torch.device | str,
        a_shard: Shard | None = None,
        b_shards: dict[str, Shard | None] | None = None,
    ) -> None:
        s, p, r = batch.num_slots, len(part_sizes), max_rank
        self.batch = batch
        self.part_names = tuple(part_sizes)
        self.a_shard = a_shard  # this rank's input columns of A (row-parallel layers)
        self.b_shards = dict(b_shards or {})  # this rank's output rows of each B (column-parallel)
        self.part_rows, start = [], 0
        for size in part_sizes.values():
            self.part_rows.append((start, size))
            start += size
        self.a = torch.zeros(s, p, r, in_features, dtype=dtype, device=device)  # [S, P, R, in]
        self.b = torch.zeros(s, start, r, dtype=dtype, device=device)  # [S, out, R]
        self.scales = torch.zeros(s, p, dtype=torch.float32, device=device)  # [S, P]
        bounds = [0] + [first + size for first, size in self.part_rows]
        self.part_offsets = torch.tensor(bounds, dtype=torch.int32, device=device)  # [P + 1]
        self._parts = None  # the kernels' OutputParts, made on first use

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b, self.scales))

    def write(self, slot: int, part: str, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Copies projection `part`'s full checkpoint-shaped A [r, in] and B [out, r] (this
        rank's slices of them) into `slot`, zero past rank r."""
        p = self.part_names.index(part)
        first, size = self.part_rows[p]
        a = a if self.a_shard is None else self.a_shard.take(a)
        shard = self.b_shards.get(part)
        b = b if shard is None else shard.take(b)
        r = a.shape[0]
        self.a[slot, p].zero_()
        self.a[slot, p, :r].copy_(a)
        rows = self.b[slot, first : first + size]
        rows.zero_()
        rows[:, :r].copy_(b)
        self.scales[slot, p] = scale

    def value_views(self, slot: int, part: str, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The views of `slot` that projection `part`'s A [rank, in] and B [out, rank] (this
        rank's slices of them) are copied into, as `write` copies them."""
        p = self.part_names.index(part)
        first, size = self.part_rows[p]
        return self.a[slot, p, :rank], self.b[slot, first : first + size, :rank]

    def shards(self, part: str) -> tuple[Shard | None, Shard | None]:
        """This rank's slices of projection `part`'s full A and B (None: all of it)."""
        return self.a_shard, self.b_shards.get(part)

    def clear(self, slot: int) -> None:
        """Zeroes `slot`: its rows then add nothing."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scales[slot].zero_()

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x: [T, in] the layer's input (this rank's slice of it for a row-parallel layer);
        out: [T, out] its output before any all-reduce. Adds every row's adapter delta to out
        in place and returns it; the rows are those of the batch's last `prepare`."""
        batch = self.batch
        if not batch.active:
            return out
        if x.shape[0] != batch.slots.shape[0]:
            raise ValueError(
                f"LoRA batch prepared for {batch.slots.shape[0]} rows, the layer got "
                f"{x.shape[0]}: call prepare() with this forward's token slots first"
            )
        if batch.use_kernels:
            return self._apply_kernels(x, out)
        return self._apply_torch(x, out)

    def _apply_torch(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        # Each live slot over all rows, masked: no host sync and no data-dependent shapes,
        # at the cost of computing every slot's delta for every row. A CUDA graph replays
        # whatever slots are loaded later: it computes them all.
        s, p, r, k = self.a.shape
        capturing = self.a.is_cuda and torch.cuda.is_current_stream_capturing()
        for slot in range(s) if capturing else self.batch.live_slots:
            rows = (self.batch.slots == slot).to(x.dtype)[:, None]
            y = (x @ self.a[slot].reshape(p * r, k).T) * rows  # [T, P x R]
            for i, (first, size) in enumerate(self.part_rows):
                b = self.b[slot, first : first + size]  # [size, R]
                delta = (y[:, i * r : (i + 1) * r] @ b.T) * self.scales[slot, i]
                out[:, first : first + size] += delta
        return out

    def _apply_kernels(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        s, p, r, k = self.a.shape
        expand = kernel("lora_expand")
        if self._parts is None:
            sizes = tuple(size for _, size in self.part_rows)
            self._parts = expand.OutputParts(sizes, self.part_offsets)
        segments, ranks = self.batch.segments, self.batch.ranks
        y = kernel("lora_shrink").lora_shrink(x, self.a.view(s, p * r, k), segments, ranks, r)
        return expand.lora_expand(y, self.b, out, segments, ranks, self.scales, self._parts)
