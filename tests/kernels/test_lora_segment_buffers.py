"""The LoRA batch layout computed on the host and written in one copy (SegmentBuffers) equals
the one lora_segments builds with device ops, for a batch and for it padded to a graph's size,
whichever of the two laid the batch out."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout.models.lora_layer import LoraBatch  # noqa: E402
from rollout.models.lora_segment_buffers import SegmentBuffers  # noqa: E402
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
    buffers = SegmentBuffers(256, num_slots, device)
    for seed in range(3):
        slots = random_slots(t, num_slots, seed=t * 10 + seed)
        buffers.write(slots.numpy())
        want = lora_segments(slots.to(device), num_slots, BLOCK_M)
        assert_same(buffers.segments(t), want)
        assert buffers.slots[:t].tolist() == slots.tolist()


@pytest.mark.parametrize(("t", "rows"), [(3, 8), (17, 32), (5, 5), (60, 256)])
def test_padding_on_the_host_equals_the_device_ops_and_keeps_no_earlier_block(device, t, rows):
    num_slots = 4
    buffers = SegmentBuffers(256, num_slots, device)
    buffers.write((torch.arange(256, dtype=torch.int32) % num_slots).numpy())  # every block full
    slots = random_slots(t, num_slots, seed=t)
    buffers.write(slots.numpy())
    buffers.pad(rows)
    padded = torch.cat([slots, torch.full((rows - t,), -1, dtype=torch.int32)])
    want = lora_segments(padded.to(device), num_slots, BLOCK_M)
    assert_same(buffers.segments(rows), want)
    assert buffers.slots[:rows].tolist() == padded.tolist()


def test_a_batch_laid_out_by_device_ops_pads_as_one_laid_out_on_the_host(device):
    # A CUDA graph is captured from device slots (lora_segments writes the buffer's views);
    # a step is prepared from host slots: padding either gives the same layout.
    slots = random_slots(11, 4, seed=3)
    on_host, on_device = SegmentBuffers(64, 4, device), SegmentBuffers(64, 4, device)
    on_host.write(slots.numpy())
    on_host.pad(16)
    lora_segments(slots.to(device), 4, out=on_device.segments(11))
    assert_same(on_device.segments(64).padded(11, 16), on_host.segments(16))


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
