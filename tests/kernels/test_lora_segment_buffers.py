"""The LoRA batch layout computed on the host and written in one copy (SegmentBuffers) equals
the one lora_segments builds with device ops, for a batch and for it padded to a graph's size;
a LoraBatch prepared from host slots and one prepared from device slots give the same views."""

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


def test_a_batch_from_device_slots_pads_to_the_same_views_as_one_from_host_slots(device):
    # A CUDA graph is captured from device slots; a step is prepared from host slots: both
    # must land in the same tensors, with the same layout.
    host, dev = LoraBatch(4, 64, device, True), LoraBatch(4, 64, device, True)
    slots = random_slots(11, 4, seed=3)
    host.prepare(slots)
    dev.prepare(slots.to(device).clone(), True)
    dev._host_laid_out = False  # noqa: SLF001 - a CPU test's slots are on the host either way
    dev._build_segments(dev.slots, persistent=True)  # noqa: SLF001
    for batch in (host, dev):
        batch.pad_to(16)
        assert batch.slots.data_ptr() == batch._slots.data_ptr()  # noqa: SLF001
    assert_same(dev.segments, host.segments)
    assert dev.slots.tolist() == host.slots.tolist()
