"""The skinny GEMM of small decode batches against torch's linear, on random inputs.

bfloat16 runs on a GPU only: Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot),
so on CPU the kernel is checked in float32, as the attention kernels are."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout.models.layers import linear  # noqa: E402
from rollout_kernels.skinny_gemm import MAX_ROWS, skinny_gemm  # noqa: E402

DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_linear(device, dtype, rows, bias):
    gen = torch.Generator().manual_seed(rows)
    # N and K not multiples of the blocks: the edges are masked.
    n, k = 72, 300
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype) if bias else None
    got = skinny_gemm(x, w, b, block_n=32, block_k=128)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (rows, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("programs", [1, 3, 7, 100])
def test_features_split_evenly_over_a_number_of_programs(device, dtype, programs):
    # 72 features over 3 programs: 24 each in tiles of 32; over 7: 11 each (the last 6); over
    # 100: one each, 72 programs.
    gen = torch.Generator().manual_seed(programs)
    n, k = 72, 300
    x = torch.randn(2, k, generator=gen).to(device, dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype)
    b = torch.randn(n, generator=gen).to(device, dtype)
    got = skinny_gemm(x, w, b, block_k=128, programs=programs)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_linear_layers_skinny_path_runs_in_every_model_dtype(device, dtype):
    # The layers' tiles (sized for bf16) in float32 too: on a GPU they must still fit in shared
    # memory, with K far below the tile (the tiny checkpoints) or far above it.
    gen = torch.Generator().manual_seed(1)
    for k in (64, 1100):
        x = torch.randn(2, k, generator=gen).to(device, dtype)
        w = (torch.randn(40, k, generator=gen) / k**0.5).to(device, dtype)
        want = torch.nn.functional.linear(x.float(), w.float())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(linear(x, w, skinny_rows=4).float(), want, atol=tol, rtol=tol)


def test_skinny_gemm_reads_strided_rows(device):
    # x may be a row-strided view (e.g. every other row of a larger activation).
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(4, 64, generator=gen).to(device)
    w = torch.randn(48, 32, generator=gen).to(device)
    x = big[::2, :32]
    torch.testing.assert_close(skinny_gemm(x, w, block_n=16, block_k=32), x @ w.T, atol=1e-5, rtol=1e-5)


def test_skinny_gemm_rejects_what_it_cannot_do(device):
    w = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="weight \\[N, K\\]"):
        skinny_gemm(torch.zeros(1, 15, device=device), w)
    with pytest.raises(ValueError, match=f"at most {MAX_ROWS} rows"):
        skinny_gemm(torch.zeros(MAX_ROWS + 1, 16, device=device), w)
    with pytest.raises(ValueError, match="programs >= 1, got 0"):
        skinny_gemm(torch.zeros(1, 16, device=device), w, programs=0)


def test_the_pipeline_is_shortened_to_fit_the_gpus_shared_memory(monkeypatch):
    # An H100 lets a program use 227 KiB; a pipeline of S stages keeps S - 1 slices of W and x
    # in shared memory. The engine's tiles (32 features by 512 of K, 16 rows of x, 5 stages:
    # 192 KiB in bf16) keep their stages; a balanced launch's 64 features a program would ask
    # 320 KiB at 5 stages and gets 3 (160 KiB); a launch reading 32 rows of x a slice would ask
    # 256 KiB and gets 4; off a GPU nothing changes.
    import rollout_kernels.skinny_gemm as skinny_module

    monkeypatch.setattr(skinny_module, "_shared_memory", lambda index: 232448)
    gpu = torch.device("cuda", 0)
    assert skinny_module.fit_stages(32, 512, 5, 2, gpu) == 5
    assert skinny_module.fit_stages(64, 512, 5, 2, gpu) == 3
    assert skinny_module.fit_stages(32, 512, 5, 2, gpu, x_rows=32) == 4
    assert skinny_module.fit_stages(1024, 512, 5, 4, gpu) == 1  # never below one stage
    assert skinny_module.fit_stages(64, 512, 5, 2, torch.device("cpu")) == 5
