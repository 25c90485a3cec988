"""Programmatic dependent launch changes when kernels start, never what they compute: a chain
of dependent kernels (each reading the last one's output) replayed from a CUDA graph gives the
same bits with PDL as without, on a GPU that has it (compute capability 9.0 or later)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rollout_kernels import pdl  # noqa: E402
from rollout_kernels.rmsnorm import rms_norm  # noqa: E402
from rollout_kernels.silu_and_mul import silu_and_mul  # noqa: E402
from rollout_kernels.skinny_gemm import skinny_gemm  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
        reason="needs a CUDA GPU of compute capability 9.0 or later",
    ),
]


def test_a_graph_of_dependent_pdl_kernels_equals_the_same_graph_without_pdl():
    torch.manual_seed(0)
    hidden, inter, layers, rows = 1024, 3072, 6, 4
    bf16 = {"dtype": torch.bfloat16, "device": "cuda"}
    weights = [
        (torch.randn(2 * inter, hidden, **bf16) / hidden**0.5,
         torch.randn(hidden, inter, **bf16) / inter**0.5,
         torch.rand(hidden, **bf16) + 0.5)
        for _ in range(layers)
    ]  # fmt: skip
    inputs = [torch.randn(rows, hidden, **bf16) for _ in range(8)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        residual = torch.zeros_like(x)
        for gate_up, down, norm in weights:  # a small model's MLP layers, nothing but Triton
            h, residual = rms_norm(x, norm, 1e-6, residual)
            x = skinny_gemm(silu_and_mul(skinny_gemm(h, gate_up)), down)
        return x + residual

    results, was = {}, pdl._enabled
    try:
        for flag in (False, True):
            pdl.set_enabled(flag)
            static = inputs[0].clone()
            forward(static)  # compiles this launch's variants outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward(static)
            replays = []
            for x in inputs:
                static.copy_(x)
                graph.replay()
                replays.append(out.clone())
            results[flag] = (torch.stack(replays), forward(inputs[-1]))  # and one eager run
    finally:
        pdl.set_enabled(was)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    assert torch.equal(results[True][0][-1], results[True][1])
