"""Paged decode and extend attention and the KV store, against a float64 torch reference.

Small shapes: on CPU these run under Triton's interpreter (see conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from paged_fixtures import make_paged_batch, reference_attention  # noqa: E402

from rollout.forward.kv_pool import to_kv_dtype  # noqa: E402
from rollout_kernels.attention_merge import merge_attention_parts  # noqa: E402
from rollout_kernels.decode_attention import LONG_PIECE_KEYS, choose_num_splits, decode_attention  # noqa: E402
from rollout_kernels.extend_attention import extend_attention  # noqa: E402
from rollout_kernels.kv_store import store_kv  # noqa: E402


@pytest.mark.parametrize(
    "heads, kv_heads, dim, seq_lens, num_splits",
    [
        (4, 2, 16, [1, 5, 40], 1),  # a one-key request, GQA group 2
        (8, 1, 32, [70, 3], 4),  # split-KV with splits both full and empty (3 keys, 4 splits)
        (6, 6, 24, [33, 9, 130], 3),  # no GQA; head dim not a power of two
    ],
)
def test_decode_attention_matches_reference(device, heads, kv_heads, dim, seq_lens, num_splits):
    batch = make_paged_batch(seq_lens, [1] * len(seq_lens), heads, kv_heads, dim, torch.float32, device)
    scale = dim**-0.5
    out = decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, scale, num_splits=num_splits,
    )
    torch.testing.assert_close(out.cpu().double(), reference_attention(batch, scale), atol=2e-5, rtol=2e-5)


def test_decode_attention_split_count_does_not_change_result(device):
    batch = make_paged_batch([600, 17], [1, 1], 4, 2, 16, torch.float32, device, seed=3)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 0.25)
    one = decode_attention(*args, num_splits=1)
    torch.testing.assert_close(decode_attention(*args, num_splits=2), one)
    # From the request's own cut (600 keys: 10 pieces) on, more splits change no bit: a CUDA
    # graph's fixed split count gives what an eager step gives.
    own = decode_attention(*args, num_splits=choose_num_splits(600))
    assert choose_num_splits(600) == 10
    assert torch.equal(decode_attention(*args, num_splits=13), own)
    assert torch.equal(decode_attention(*args, num_splits=16), own)
    torch.testing.assert_close(own, one)


def test_decode_attention_in_long_pieces_cuts_only_the_long_requests(device):
    """min_keys_per_split (the large decode batches' pieces): a request of at most that many
    keys is one program, whatever num_splits allows; a longer one is cut, one piece per that
    many keys, and its result is the reference's."""
    batch = make_paged_batch([600, 17, 150], [1, 1, 1], 4, 2, 16, torch.float32, device, seed=7)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 0.25)
    whole = decode_attention(*args, num_splits=1)
    pieces = decode_attention(*args, num_splits=16, min_keys_per_split=200)
    assert choose_num_splits(600, 200) == 3 and choose_num_splits(150, 200) == 1
    assert torch.equal(pieces[1:], whole[1:])  # 17 and 150 keys: one piece each, the same bits
    assert not torch.equal(pieces[0], whole[0])  # 600 keys: three pieces, merged
    torch.testing.assert_close(pieces.cpu().double(), reference_attention(batch, 0.25), atol=2e-5, rtol=2e-5)
    # As with the default pieces, more splits than the request's own cut change no bit.
    assert torch.equal(decode_attention(*args, num_splits=3, min_keys_per_split=200), pieces)
    with pytest.raises(ValueError, match="min_keys_per_split must be >= 1, got 0"):
        decode_attention(*args, num_splits=1, min_keys_per_split=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_in_long_pieces_at_model_shapes_matches_reference(device, dtype):
    """The large decode batches' launch at a head dim of 128: pieces of LONG_PIECE_KEYS keys (in
    16-bit, stepped through BLOCK_N_LONG keys at a time); requests just under, at and over a
    piece, and most of the launch's programs empty (16 splits for at most 3 pieces)."""
    if dtype == torch.bfloat16 and torch.device(device).type != "cuda":
        pytest.skip("Triton's interpreter gets tl.dot of bfloat16 wrong; runs on CUDA")
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    lengths = [2500, 17, LONG_PIECE_KEYS, LONG_PIECE_KEYS + 1]
    batch = make_paged_batch(lengths, [1] * 4, 8, 2, 128, dtype, device, seed=11)
    args = (batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices, batch.seq_lens, 128**-0.5)
    pieces = decode_attention(*args, num_splits=16, min_keys_per_split=LONG_PIECE_KEYS)
    torch.testing.assert_close(pieces.cpu().double(), reference_attention(batch, 128**-0.5), **tol)
    assert torch.equal(decode_attention(*args, num_splits=3, min_keys_per_split=LONG_PIECE_KEYS), pieces)


def test_decode_attention_of_a_request_does_not_depend_on_its_batch(device):
    batch = make_paged_batch([600, 17, 290], [1, 1, 1], 4, 2, 16, torch.float32, device, seed=5)
    full = decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, 0.25, num_splits=choose_num_splits(600),
    )
    for i in range(3):
        alone = decode_attention(
            batch.q[i : i + 1], batch.k_cache, batch.v_cache, batch.req_to_token,
            batch.req_pool_indices[i : i + 1], batch.seq_lens[i : i + 1], 0.25,
            num_splits=choose_num_splits(int(batch.seq_lens[i])),
        )
        assert torch.equal(alone[0], full[i])
    # A CUDA graph's padding rows have no keys and leave the real rows' bits alone.
    padded = decode_attention(
        torch.cat([batch.q, batch.q[:1]]), batch.k_cache, batch.v_cache, batch.req_to_token,
        torch.cat([batch.req_pool_indices, batch.req_pool_indices[:1]]),
        torch.cat([batch.seq_lens, torch.zeros_like(batch.seq_lens[:1])]), 0.25, num_splits=16,
    )
    assert torch.equal(padded[:3], full)


def test_decode_attention_gives_padding_rows_zeros(device):
    # CUDA-graph padding rows have no keys: they must come out finite and leave others alone.
    batch = make_paged_batch([9, 1], [1, 1], 4, 2, 16, torch.float32, device, seed=4)
    seq_lens = torch.tensor([9, 0], device=device)
    out = decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        seq_lens, 0.25, num_splits=3,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    torch.testing.assert_close(out[0].cpu().double(), reference_attention(batch, 0.25)[0], atol=2e-5, rtol=2e-5)


def test_choose_num_splits():
    assert choose_num_splits(50) == 1  # short: one split is enough
    assert choose_num_splits(300) == 5  # one per 64 keys
    assert choose_num_splits(1 << 20) == 16  # capped


@pytest.mark.parametrize(
    "heads, kv_heads, dim, seq_lens, extend_lens",
    [
        (4, 2, 16, [37, 5, 1], [37, 2, 1]),  # fresh prompt, short extends, a one-token extend
        (8, 2, 32, [80, 41], [33, 40]),  # cached prefixes; extends span several query blocks
        (3, 1, 24, [20], [20]),  # head dim not a power of two
    ],
)
def test_extend_attention_matches_reference(device, heads, kv_heads, dim, seq_lens, extend_lens):
    batch = make_paged_batch(seq_lens, extend_lens, heads, kv_heads, dim, torch.float32, device, seed=1)
    scale = dim**-0.5
    out = extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, batch.extend_lens, batch.extend_starts, max(extend_lens), scale,
    )
    torch.testing.assert_close(out.cpu().double(), reference_attention(batch, scale), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_each_token_to_its_slot(device, dtype):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 4 * 8 + 2 * 2 * 8, generator=gen).to(device, dtype)
    # k as the models pass it: a strided view into the fused qkv projection.
    k = qkv[:, 32:48].view(5, 2, 8)
    v = qkv[:, 48:].contiguous().view(5, 2, 8)
    k_cache = torch.zeros(12, 2, 8, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.tensor([3, 11, 1, 7, 4], device=device)
    store_kv(k, v, k_cache, v_cache, loc)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    want_k[loc], want_v[loc] = k, v
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8)
def test_store_kv_into_an_fp8_cache_rounds_and_clamps_as_the_pool_does(device, cache_dtype):
    gen = torch.Generator().manual_seed(2)
    k = (torch.randn(6, 2, 8, generator=gen) * 3).to(device, torch.bfloat16)
    v = (torch.randn(6, 2, 8, generator=gen) * 3).to(device, torch.bfloat16)
    big = torch.finfo(cache_dtype).max
    k[0, 0, :4] = torch.tensor([big * 4, -big * 4, 1e-3, -2e-4])  # past the range; tiny values
    k_cache = torch.zeros(10, 2, 8, dtype=cache_dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    loc = torch.tensor([2, 9, 5, 1, 4, 7], device=device)
    store_kv(k, v, k_cache, v_cache, loc)
    assert k_cache[2, 0, 0].float() == big and k_cache[2, 0, 1].float() == -big  # clamped, not inf or NaN
    for got, x in ((k_cache, k), (v_cache, v)):
        want = torch.zeros_like(got)
        want[loc] = to_kv_dtype(x, cache_dtype)
        got, want = got.float().cpu(), want.float().cpu()
        if torch.device(device).type == "cuda":
            assert torch.equal(got, want)  # the same rounding as the torch pool
        else:
            # Triton's interpreter converts to 8-bit floats its own way (ties away from zero,
            # no carry into the exponent: -7.875 becomes -4): the rounding is checked on CUDA;
            # here, where the values went.
            untouched = torch.ones(10, dtype=torch.bool)
            untouched[loc.cpu()] = False
            assert not got[untouched].any()
            assert (got[loc.cpu()] != 0).float().mean() > 0.9


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_an_fp8_cache(device, cache_dtype, dtype):
    # Queries in the model's dtype against keys and values stored in 8 bits: the result of
    # attending over the stored (rounded) values, in the model's precision.
    if dtype == torch.bfloat16 and torch.device(device).type != "cuda":
        pytest.skip("Triton's interpreter gets tl.dot of bfloat16 wrong (any cache dtype); runs on CUDA")
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    batch = make_paged_batch([70, 3, 41], [1, 1, 1], 4, 2, 16, dtype, device, seed=6)
    batch.k_cache, batch.v_cache = to_kv_dtype(batch.k_cache, cache_dtype), to_kv_dtype(batch.v_cache, cache_dtype)
    out = decode_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, 0.25, num_splits=choose_num_splits(70),
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), reference_attention(batch, 0.25), **tol)
    batch = make_paged_batch([40, 9], [40, 4], 4, 2, 16, dtype, device, seed=7)
    batch.k_cache, batch.v_cache = to_kv_dtype(batch.k_cache, cache_dtype), to_kv_dtype(batch.v_cache, cache_dtype)
    out = extend_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.req_to_token, batch.req_pool_indices,
        batch.seq_lens, batch.extend_lens, batch.extend_starts, 40, 0.25,
    )
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().double(), reference_attention(batch, 0.25), **tol)


def test_store_kv_rejects_mismatched_shapes(device):
    cache = torch.zeros(4, 2, 8, device=device)
    with pytest.raises(ValueError, match="Hkv, D"):
        store_kv(torch.zeros(1, 3, 8, device=device), torch.zeros(1, 3, 8, device=device), cache, cache, torch.tensor([1]))


def test_merge_reads_nothing_of_empty_parts_and_trailing_ones_change_no_bit(device):
    gen = torch.Generator().manual_seed(6)
    parts = torch.randn(2, 3, 5, 16, generator=gen).to(device)
    lse = torch.randn(2, 3, 5, generator=gen).to(device)
    lse[:, :, 3:] = float("-inf")  # parts 3 and 4 are empty: never written, here NaN
    parts[:, :, 3:] = float("nan")
    lse[1, 2, :] = float("-inf")  # a row with no keys at all
    out = torch.empty(2, 3, 16, device=device)
    merge_attention_parts(parts, lse, out)
    weights = torch.softmax(lse[0, :, :3], dim=-1)
    want = (parts[0, :, :3] * weights[..., None]).sum(1)
    torch.testing.assert_close(out[0], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[1, 2], torch.zeros(16, device=device))
    fewer = torch.empty_like(out)
    merge_attention_parts(parts[:, :, :3].contiguous(), lse[:, :, :3].contiguous(), fewer)
    assert torch.equal(out, fewer)
