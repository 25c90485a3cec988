"""The batch layout both LoRA kernels read: token rows grouped by adapter slot.

A forward batch mixes rows of several adapters and base-only rows in any order. Instead of
moving rows, the kernels read them through `order`, the row indices sorted by slot, and give
each program BLOCK_M rows of one slot: slot s owns order[seg_start[s] : seg_start[s] +
seg_len[s]] and blocks block_end[s] - cdiv(seg_len[s], BLOCK_M) .. block_end[s] - 1 of the
grid. Base-only rows sort last and get no block. Every tensor here has a size fixed by the
number of rows and of slots, so a CUDA graph captured over persistent ones replays any later
batch of as many rows written into them.

A grid of cdiv(T, BLOCK_M) + min(S, T) - 1 blocks always covers every slot's blocks: at most
min(S, T) slots have rows, and the blocks of k slots with rows number at most cdiv(T, BLOCK_M)
+ k - 1 (cdiv(a) + cdiv(b) <= cdiv(a + b) + 1). Each block's slot, first index into `order`
and row count are tabled per block (`block_slot`, `block_first`, `block_rows`), so that a
program finds its rows with one read instead of a chain of dependent ones; the blocks past the
last slot's are empty and their programs return at once; a decode of one row runs one block,
whatever the slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows per program: tl.dot's smallest tile
# A batch of more rows than this (a long prefill, run eagerly) is grouped in blocks of
# LONG_BLOCK_M rows: a program's tile of y and B then serves four times the rows, and the
# grid is a quarter as long. A decode batch keeps blocks of 16: its slots hold few rows each.
LONG_ROWS = 1024
LONG_BLOCK_M = 64


def block_m_for(rows: int) -> int:
    """The rows per program block of a batch of `rows` token rows."""
    return LONG_BLOCK_M if rows > LONG_ROWS else BLOCK_M


@dataclass(frozen=True)
class LoraSegments:
    """Token rows grouped by adapter slot (see the module docstring); int32 device tensors."""

    order: torch.Tensor  # [T]: row indices, sorted by slot (stable), base-only rows last
    seg_start: torch.Tensor  # [S]: where each slot's rows start in `order`
    seg_len: torch.Tensor  # [S]: how many rows each slot has
    block_end: torch.Tensor  # [S]: cumulative sum of cdiv(seg_len, block_m)
    block_slot: torch.Tensor  # [G]: each program block's slot (S: an empty block)
    block_first: torch.Tensor  # [G]: where its rows start in `order`
    block_rows: torch.Tensor  # [G]: how many rows it has (0 for an empty block)
    block_m: int = BLOCK_M

    @property
    def num_tokens(self) -> int:
        return self.order.shape[0]

    @property
    def num_slots(self) -> int:
        return self.seg_len.shape[0]

    def grid_blocks(self) -> int:
        """Program blocks along the rows that cover every slot's rows, whatever the slots."""
        return grid_blocks(self.num_tokens, self.num_slots, self.block_m)

    def rows(self, t: int) -> LoraSegments:
        """Views of these (persistent) tensors for a batch of t rows: what a batch of t rows
        is written into, and what a CUDA graph of t rows reads."""
        g = grid_blocks(t, self.num_slots, self.block_m)
        return LoraSegments(
            self.order[:t], self.seg_start, self.seg_len, self.block_end, self.block_slot[:g],
            self.block_first[:g], self.block_rows[:g], self.block_m,
        )  # fmt: skip

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The seven tensors, in field order (as `host_layout` returns their values)."""
        return (
            self.order, self.seg_start, self.seg_len, self.block_end, self.block_slot,
            self.block_first, self.block_rows,
        )  # fmt: skip


def grid_blocks(t: int, num_slots: int, block_m: int) -> int:
    """Program blocks along the rows that cover the rows of t tokens over num_slots slots."""
    # NOTE: plain ints: triton.cdiv costs ~1.5 us a call from the host, and this runs on
    # every step's host path (SegmentBuffers) several times.
    return -(-t // block_m) + min(num_slots, t) - 1 if t else 0


def lora_segments(slots: torch.Tensor, num_slots: int, block_m: int | None = None) -> LoraSegments:
    """slots: [T] int, each row's adapter slot in [0, num_slots), anything else (-1) for a
    base-only row. Returns the layout in blocks of `block_m` rows (None: block_m_for(T)), built
    with device ops. (The engine lays its batches out on the host and copies them once:
    rollout/models/lora_segment_buffers.py; this is that layout's reference.)"""
    t = slots.shape[0]
    block_m = block_m_for(t) if block_m is None else block_m
    key = slots.long()
    key = torch.where((key < 0) | (key >= num_slots), num_slots, key)
    order = torch.argsort(key, stable=True)
    # scatter_add, not bincount: bincount's output size depends on the values (a host sync).
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slots.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    seg_len = counts[:num_slots]
    seg_start = torch.cumsum(seg_len, 0) - seg_len
    per_slot = (seg_len + block_m - 1) // block_m
    block_end = torch.cumsum(per_slot, 0)
    # Block b belongs to the first slot whose blocks end past it (num_slots: none does).
    blocks = torch.arange(grid_blocks(t, num_slots, block_m), device=slots.device)
    slot = torch.searchsorted(block_end, blocks, right=True)
    safe = slot.clamp(max=num_slots - 1)
    local = blocks - (block_end - per_slot)[safe]  # the block's index within its slot
    rows = (seg_len[safe] - local * block_m).clamp(0, block_m)
    values = (
        order, seg_start, seg_len, block_end, slot, seg_start[safe] + local * block_m,
        torch.where(slot < num_slots, rows, 0),
    )  # fmt: skip
    return LoraSegments(*(v.to(torch.int32) for v in values), block_m=block_m)


@triton.jit
def segment_rows(
    block_slot_ptr, block_first_ptr, block_rows_ptr, order_ptr, pid, BLOCK_M: tl.constexpr
):  # fmt: skip
    """(slot, token rows [BLOCK_M], row mask) of program block `pid`; the slot is the number
    of slots when the block has no rows (the caller returns)."""
    slot = tl.load(block_slot_ptr + pid)
    first = tl.load(block_first_ptr + pid)
    rmask = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + pid)
    tokens = tl.load(order_ptr + first + tl.arange(0, BLOCK_M), mask=rmask, other=0)
    return slot, tokens, rmask
