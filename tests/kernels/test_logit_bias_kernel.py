"""The sampling kernel path (sample(..., use_kernel=True)) applies logit_bias as the torch
sampler does: the bias is added in torch before the kernel draws."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout.engine.sampler import SamplingBatch, sample  # noqa: E402
from rollout.engine.sampling_params import SamplingParams  # noqa: E402

VOCAB = 1000


def test_kernel_and_torch_paths_draw_the_same_biased_tokens(device):
    params = [
        SamplingParams(temperature=0.9, logit_bias={3: 5.0, 500: 8.0}),
        SamplingParams(temperature=1.0, top_p=0.9, logit_bias={7: -100, 8: 100}),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=0, logit_bias={999: 100}),
    ]
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(len(params), VOCAB, generator=gen).to(device)
    batch = SamplingBatch.build(params, [1, 2, 3, 4], [[]] * 4, [[1]] * 4, [2], VOCAB, device)
    want = sample(logits.clone(), batch)
    got = sample(logits.clone(), batch, use_kernel=True)
    assert got.tolist() == want.tolist()
    assert want[1].item() == 8 and want[3].item() == 999
