"""The adapter slots of one linear layer, and the per-forward state every such layer reads.

A LoraLayer holds fixed-size A and B buffers for every slot of one linear layer of the model:
a projection group (the fused QKV, gate/up) or a single projection (o_proj, down_proj).
`apply` adds each token row's adapter delta to the layer's output, in place; rows of slot -1
(base only) are left alone. Everything a forward reads lives in buffers allocated once, so a
CUDA graph captured with LoRA replays any later mix of adapters.

Beside the base GEMM: for a batch of up to `LoraBatch.beside_rows` rows on the kernels' path
(small decode batches, where LoRA's launches cost more than their reads), `around` runs the
layer's shrink on a second CUDA stream while the base GEMM runs, the step's stream waiting for
it only after the GEMM: a decode step's LoRA launches then mostly hide behind the GEMMs. A layer
whose output goes straight to a kernel that can add a delta as it reads it (`defers`: the norm
after o_proj and down_proj, SiLU-and-mul after gate/up, linked by AdapterSlots) runs its expand
there too, into a float32 delta that the kernel after it takes (`take_delta`) and adds, rounding
the sum once to the output's dtype as the expand into the output does.

Tensor parallelism: a column-parallel layer (QKV, gate/up) keeps A whole and this rank's rows
of B, and its delta is this rank's columns of the output. A row-parallel layer (o_proj,
down_proj) keeps this rank's input columns of A and B whole; its delta from this rank's slice
of the input is a partial sum, added before the layer's all-reduce, which sums it with the
base output's partials (x @ A^T is linear in the input slices).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

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
        self.beside_rows = 0  # forwards of at most this many rows run LoRA beside the GEMMs
        self.side_stream: torch.cuda.Stream | None = None

    def run_beside(self, max_rows: int) -> None:
        """Forwards of 1..max_rows rows on the kernels' path run each layer's LoRA kernels
        beside its base GEMM (LoraLayer.around), on a second stream where the device has
        streams; 0: never (every layer adds its delta after its GEMM)."""
        self.beside_rows = max_rows if self.use_kernels else 0
        if self.beside_rows and self.device.type == "cuda" and self.side_stream is None:
            self.side_stream = torch.cuda.Stream(self.device)

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
        # A kernel after this layer adds its delta (take_delta) when it runs beside the GEMM.
        self.defers = False
        self._owed: torch.Tensor | None = None  # the delta of the last forward, not yet taken

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

    def around(self, x: torch.Tensor, base: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The layer's output with every row's adapter delta: `base()` computes it without
        them (the base GEMM, before any all-reduce) from x [T, in] (this rank's slice of the
        input for a row-parallel layer). For a batch of up to `beside_rows` rows the shrink
        runs beside base() (module docstring), and a layer that `defers` leaves its delta to
        the kernel after it: the output is then returned without it, and `take_delta` gives
        it. Otherwise `apply` after base()."""
        batch = self.batch
        self._owed = None
        if not (batch.active and batch.use_kernels and 0 < x.shape[0] <= batch.beside_rows):
            return self.apply(x, base())
        self._check_rows(x)
        side = batch.side_stream if x.is_cuda else None
        main = None if side is None else torch.cuda.current_stream(x.device)
        if side is not None:
            side.wait_stream(main)
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
            y = self._shrink(x)
            if self.defers:
                delta = x.new_zeros((x.shape[0], self.b.shape[1]), dtype=torch.float32)
                self._expand(y, delta)
        out = base()
        if side is not None:
            main.wait_stream(side)
        if self.defers:
            self._owed = delta
            return out
        return self._expand(y, out)

    def take_delta(self) -> torch.Tensor | None:
        """The float32 delta [T, out] the last `around` left for the kernel after the layer to
        add (None: it added its delta itself, or there was none); given once."""
        owed, self._owed = self._owed, None
        return owed

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x: [T, in] the layer's input (this rank's slice of it for a row-parallel layer);
        out: [T, out] its output before any all-reduce. Adds every row's adapter delta to out
        in place and returns it; the rows are those of the batch's last `prepare`."""
        batch = self.batch
        if not batch.active:
            return out
        self._check_rows(x)
        if batch.use_kernels:
            return self._expand(self._shrink(x), out)
        return self._apply_torch(x, out)

    def _check_rows(self, x: torch.Tensor) -> None:
        if x.shape[0] != self.batch.slots.shape[0]:
            raise ValueError(
                f"LoRA batch prepared for {self.batch.slots.shape[0]} rows, the layer got "
                f"{x.shape[0]}: call prepare() with this forward's token slots first"
            )

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

    def _shrink(self, x: torch.Tensor) -> torch.Tensor:
        s, p, r, k = self.a.shape
        batch = self.batch
        return kernel("lora_shrink").lora_shrink(
            x, self.a.view(s, p * r, k), batch.segments, batch.ranks, r
        )

    def _expand(self, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds the deltas from the shrink's y to out (the layer's output, or a float32 delta)."""
        expand = kernel("lora_expand")
        if self._parts is None:
            sizes = tuple(size for _, size in self.part_rows)
            self._parts = expand.OutputParts(sizes, self.part_offsets)
        batch = self.batch
        return expand.lora_expand(
            y, self.b, out, batch.segments, batch.ranks, self.scales, self._parts
        )
