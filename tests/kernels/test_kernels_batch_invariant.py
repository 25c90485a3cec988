"""The kernels of deterministic inference: the batch-invariant GEMM and the deterministic
attention kernel against torch references, and the property they exist for: a row's result
is the same bits whatever else is computed with it and wherever it sits.

float32 on CPU (the interpreter); bfloat16 too on a GPU."""

from __future__ import annotations

import pytest
import torch
from paged_fixtures import make_paged_batch, reference_attention

pytest.importorskip("triton")

from rollout_kernels.batch_invariant_gemm import batch_invariant_linear  # noqa: E402
from rollout_kernels.deterministic_attention import deterministic_attention  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


def _gemm_inputs(device, dtype, m=70, n=200, k=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    return x, w, b


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_linear(device, dtype, bias):
    x, w, b = _gemm_inputs(device, dtype)
    b = b if bias else None
    got = batch_invariant_linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    logits = batch_invariant_linear(x, w, out_dtype=torch.float32)
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_rows_do_not_depend_on_the_batch(device, dtype):
    x, w, b = _gemm_inputs(device, dtype)
    full = batch_invariant_linear(x, w, b)
    gen = torch.Generator().manual_seed(1)
    for rows in (1, 3, 8, 32):
        pick = torch.randperm(x.shape[0], generator=gen)[:rows].to(device)
        assert torch.equal(batch_invariant_linear(x[pick], w, b), full[pick]), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_k_in_fixed_pieces_gives_the_same_bits_on_one_program_or_one_per_piece(device, dtype, bias):
    # K of 400 in 3 pieces (192, 192, 16 with the CPU's tiles): split over programs or summed
    # in one, a row's result is the same, in any batch, and within rounding of torch's.
    x, w, b = _gemm_inputs(device, dtype, k=400)
    b = b if bias else None
    whole = batch_invariant_linear(x, w, b, k_chunks=3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(whole.float(), want, atol=tol, rtol=tol)
    for rows in (1, 5, 70):
        assert torch.equal(batch_invariant_linear(x[:rows], w, b, k_chunks=3, split=True), whole[:rows])
        assert torch.equal(batch_invariant_linear(x[-rows:], w, b, k_chunks=3), whole[-rows:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_columns_do_not_depend_on_their_neighbours(device, dtype):
    # A merged projection (qkv) and its parts computed one by one (the parity model's way)
    # give the same bits, written side by side into one buffer or not.
    x, w, b = _gemm_inputs(device, dtype)
    full = batch_invariant_linear(x, w, b)
    assert torch.equal(batch_invariant_linear(x, w[50:90], b[50:90]), full[:, 50:90])
    buffer = torch.zeros(x.shape[0], 300, dtype=dtype, device=device)
    batch_invariant_linear(x, w[:40], b[:40], out=buffer[:, 10:50])
    assert torch.equal(buffer[:, 10:50], full[:, :40])


def _attend(batch, out_rows=None):
    return deterministic_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, batch.extend_lens, batch.extend_starts,
        int(batch.extend_lens.max()), 0.125,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (6, 2)])
def test_attention_matches_the_reference(device, dtype, heads, kv_heads):
    # Prefill, a cache-hit extend and decodes in one batch; group sizes 1, 4 and 3.
    batch = make_paged_batch([45, 70, 9, 33], [45, 20, 1, 1], heads, kv_heads, 32, dtype, device)
    got = _attend(batch).float().cpu()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, reference_attention(batch, 0.125).float(), atol=tol, rtol=tol)


def _one_request(batch, b: int, prefix: int, count: int):
    """The batch of request b alone, extending tokens prefix .. prefix + count - 1 (their
    queries taken from its full-prefill rows) on top of the cached keys 0 .. prefix - 1."""
    start = int(batch.extend_starts[b]) + prefix
    one = type(batch)(**vars(batch))
    dev = batch.q.device
    one.q = batch.q[start : start + count]
    one.req_pool_indices = batch.req_pool_indices[b : b + 1]
    one.seq_lens = torch.tensor([prefix + count], device=dev)
    one.extend_lens = torch.tensor([count], device=dev)
    one.extend_starts = torch.tensor([0], device=dev)
    return one


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_attention_rows_are_the_same_however_the_token_got_there(device, dtype, heads, kv_heads):
    # Request 0's tokens: in a prefill batched with others, alone, in chunks of 7 and 64, and
    # decoded one at a time: the same bits every time.
    lens = [70, 5, 33, 1]
    batch = make_paged_batch(lens, lens, heads, kv_heads, 32, dtype, device, seed=3)
    batched = _attend(batch)[:70]
    assert torch.equal(_attend(_one_request(batch, 0, 0, 70)), batched)
    for chunk in (7, 64):
        pieces = [
            _attend(_one_request(batch, 0, s, min(chunk, 70 - s))) for s in range(0, 70, chunk)
        ]
        assert torch.equal(torch.cat(pieces), batched), chunk
    for pos in (0, 6, 31, 32, 69):
        assert torch.equal(_attend(_one_request(batch, 0, pos, 1))[0], batched[pos]), pos


def test_attention_gives_requests_without_keys_zeros(device):
    # A CUDA graph's padding rows: no keys, zeros out, and the real rows unchanged.
    batch = make_paged_batch([12, 1], [1, 1], 4, 2, 32, torch.float32, device)
    real = _attend(batch)
    batch.seq_lens = torch.tensor([12, 0], device=device)
    padded = _attend(batch)
    assert torch.equal(padded[0], real[0])
    assert not padded[1].any()
