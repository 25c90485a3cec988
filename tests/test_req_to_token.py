"""ReqToTokenPool: writes land in the device table and in its host copy alike."""

from __future__ import annotations

import pytest
import torch
from devices import CPU_AND_CUDA

from rollout.forward.kv_pool import ReqToTokenPool

DEVICES = CPU_AND_CUDA


@pytest.mark.parametrize("device", DEVICES)
def test_writes_reach_the_table_and_its_host_copy(device):
    pool = ReqToTokenPool(4, 16, device)
    pool.write(1, 2, torch.tensor([5, 6, 7]))
    pool.write_many(torch.tensor([0, 1, 3]), torch.tensor([0, 5, 15]), torch.tensor([9, 8, 11]))
    expected = torch.zeros(4, 16, dtype=torch.int64)
    expected[1, 2:6] = torch.tensor([5, 6, 7, 8])
    expected[0, 0], expected[3, 15] = 9, 11
    assert torch.equal(pool.host, expected)
    assert torch.equal(pool.table.cpu(), expected)
    assert pool.read(1, 2, 6).tolist() == [5, 6, 7, 8]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_write_sources_may_be_reused_at_once():
    # The copies are non-blocking: they must have taken the source's values by the time the
    # call returns, even while the device is still busy with earlier work.
    pool = ReqToTokenPool(2, 1 << 16, "cuda")
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        busy = busy @ busy
    slots, doubled = torch.arange(1, (1 << 16) + 1), torch.arange(2, (2 << 16) + 1, 2)
    rows, cols = torch.ones(1 << 16, dtype=torch.int64), torch.arange(1 << 16)
    pool.write(0, 0, slots)
    pool.write_many(rows, cols, doubled)
    for t in (slots, doubled, rows, cols):
        t.zero_()
    torch.cuda.synchronize()
    assert torch.equal(pool.table[0].cpu(), torch.arange(1, (1 << 16) + 1))
    assert torch.equal(pool.table[1].cpu(), 2 * torch.arange(1, (1 << 16) + 1))
