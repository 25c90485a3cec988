"""The LoRA batch layout computed on the host and written in one copy (SegmentBuffers) equals
the one lora_segments builds with device ops, for a batch and for it padded to a graph's size;
a padded batch reads its own rows only, whatever an earlier batch left in the buffers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout.models.lora_layer import LoraBatch  # noqa: E402
from rollout.models.lora_segment_buffers import SegmentBuffers  # noqa: E402
from rollout_kernels.lora_expand import (  # noqa: E402
    OutputParts,
    lora_expand,
    lora_expand_reference,
)
from rollout_kernels.lora_segments import BLOCK_M, LoraSegments, lora_segments  # noqa: E402

FIELDS = ("order", "seg_start", "seg_len", "block_end", "block_slot", "block_first", "block_rows")


def random_slots(t: int, num_slots: int, seed: int) -> torch.Tensor:
    """Rows of every slot, base-only rows (-1) and slots past the last (base-only too)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, num_slots + 2, (t,), generator=gen, dtype=torch.int32)


def assert_same(got: LoraSegments, want: LoraSegments) -> None:
    for field in FIELDS[:-2]:
        assert getattr(got, field).tolist() == getattr(want, field).tolist(), field
    assert got.block_rows.tolist() == want.block_rows.tolist()
    used = want.block_rows > 0  # an empty block's first row is never read
    assert got.block_first[used].tolist() == want.block_first[used].tolist()
    assert got.block_m == want.block_m


@pytest.mark.parametrize(("t", "num_slots"), [(1, 9), (5, 3), (16, 2), (37, 4), (64, 9), (200, 5)])
def test_the_host_layout_equals_the_device_ops(device, t, num_slots):
    buffers = SegmentBuffers(256, num_slots, device, BLOCK_M)
    for seed in range(3):
        slots = random_slots(t, num_slots, seed=t * 10 + seed)
        buffers.write(slots.numpy())
        want = lora_segments(slots.to(device), num_slots, BLOCK_M)
        assert_same(buffers.segments(t), want)
        assert buffers.slots[:t].tolist() == slots.tolist()


@pytest.mark.parametrize(("t", "rows"), [(3, 8), (17, 32), (5, 5), (60, 256)])
def test_padding_on_the_host_equals_the_device_ops_and_keeps_no_earlier_block(device, t, rows):
    num_slots = 4
    buffers = SegmentBuffers(256, num_slots, device, BLOCK_M)
    buffers.write((torch.arange(256, dtype=torch.int32) % num_slots).numpy())  # every block full
    slots = random_slots(t, num_slots, seed=t)
    buffers.write(slots.numpy())
    buffers.pad(rows)
    padded = torch.cat([slots, torch.full((rows - t,), -1, dtype=torch.int32)])
    want = lora_segments(padded.to(device), num_slots, BLOCK_M)
    assert_same(buffers.segments(rows), want)
    assert buffers.slots[:rows].tolist() == padded.tolist()


def test_a_padded_batch_in_persistent_buffers_keeps_no_block_of_an_earlier_batch(device):
    # The persistent buffer held a batch of 64 rows (every block full); a batch of 3 rows
    # padded to 64 must read its 3 rows and nothing else.
    buffers = SegmentBuffers(64, 4, device, BLOCK_M)
    buffers.write((torch.arange(64, dtype=torch.int32) % 4).numpy())
    full_blocks = buffers.segments(64).grid_blocks()
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    buffers.write(slots.numpy())
    buffers.pad(64)
    padded = buffers.segments(64)
    assert padded.num_tokens == 64 and padded.grid_blocks() == full_blocks
    assert padded.block_rows.sum().item() == 2
    ranks = torch.tensor([8, 16, 4, 0], dtype=torch.int32, device=device)
    b = torch.randn(4, 24, 16, device=device) / 4
    for s, rank in enumerate(ranks.tolist()):
        b[s, :, rank:] = 0  # as LoraLayer's slots hold it
    y = torch.randn(1, 64, 16, device=device)
    out = torch.randn(64, 24, device=device)
    scales = torch.ones(4, 1, device=device)
    got = lora_expand(y, b, out.clone(), padded, ranks, scales, OutputParts.make([24], device))
    all_slots = torch.cat([slots, torch.full((61,), -1, dtype=torch.int32)]).to(device)
    want = lora_expand_reference(y[0], b, out, all_slots, scales, [24], ranks)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[3:], out[3:])


def test_a_lora_batch_from_host_slots_pads_in_its_persistent_buffers(device):
    batch = LoraBatch(4, 64, device, use_kernels=True)
    batch.prepare_requests([2, -1, 0], [1, 1, 1])
    persistent = batch.slots.data_ptr()
    batch.pad_to(8)
    assert batch.slots.data_ptr() == persistent and batch.slots.tolist() == [2, -1, 0] + [-1] * 5
    want = lora_segments(batch.slots.clone(), 4, BLOCK_M)
    assert_same(batch.segments, want)
    with pytest.raises(ValueError, match="pad_to\\(2\\)"):
        batch.pad_to(2)


@pytest.mark.parametrize("max_tokens", [1, 17, 1025, 1520])
@pytest.mark.parametrize("num_slots", [2, 3, 9])
def test_every_view_starts_16_bytes_aligned_whatever_the_buffer_size(device, max_tokens, num_slots):
    # Triton specializes pointer arguments on 16-byte alignment: a view whose start moved with
    # the buffer's size would make a long prefill's own buffer compile kernel variants the
    # warm-up (on the persistent buffer) never built.
    buffers = SegmentBuffers(max_tokens, num_slots, device, BLOCK_M)
    views = [buffers.slots, *buffers.segments(max_tokens).tensors()]
    assert all(view.data_ptr() % 16 == 0 for view in views)
