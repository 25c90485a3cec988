"""row_logsumexp (one read of the logits, chunks on programs of their own) against
torch.logsumexp: random rows, rows of -inf, large magnitudes, one chunk or many."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout_kernels.row_logsumexp import row_logsumexp  # noqa: E402


@pytest.mark.parametrize("vocab, chunk, block", [(1000, 256, 64), (1000, 8192, 1024), (300, 100, 32), (7, 8192, 1024)])
def test_matches_torch_logsumexp(device, vocab, chunk, block):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=gen).mul(4)
    x[1] *= 2000.0  # magnitudes where a naive sum of exp overflows
    x[2, : vocab // 2] = float("-inf")  # banned tokens: whole chunks of -inf
    x[3] = float("-inf")
    x[3, vocab - 1] = 2.5  # one finite entry, in the last chunk
    x = x.to(device)
    got = row_logsumexp(x, chunk=chunk, block=block)
    want = torch.logsumexp(x, dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert got[3].item() == pytest.approx(2.5)


def test_a_row_of_only_minus_inf_gets_minus_inf(device):
    x = torch.full((2, 500), float("-inf"), device=device)
    x[1, 7] = 0.0
    got = row_logsumexp(x, chunk=128, block=64)
    assert got[0].item() == float("-inf") and got[1].item() == pytest.approx(0.0)


def test_rows_of_a_wider_buffer_and_bad_input(device):
    wide = torch.randn(4, 640, device=device)
    rows = wide[:, :600]  # strided rows: each row contiguous
    torch.testing.assert_close(row_logsumexp(rows, chunk=256, block=64), torch.logsumexp(rows, -1))
    assert row_logsumexp(torch.empty(0, 10, device=device)).shape == (0,)
    with pytest.raises(ValueError, match="float32"):
        row_logsumexp(torch.randn(2, 10, device=device, dtype=torch.float64))
