"""Triton's interpreter as the kernels run under it on a CPU (rollout_kernels.interpreter): a
kernel calling jitted helpers, of this package and of Triton's standard library, computes what
torch does, and the language is as it was once the launch is over."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
tl = triton.language

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
    pytest.skip("the kernels are compiled here, not interpreted", allow_module_level=True)

from rollout_kernels.interpreter import swap_once_a_launch  # noqa: E402
from rollout_kernels.rmsnorm import weighted_norm  # noqa: E402


@triton.jit
def _scaled_row_sum(x, n: tl.constexpr):
    return tl.sum(x, axis=0) / n  # tl.sum: a jitted helper of Triton's standard library


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, mean_ptr, eps, N: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + row * N + cols).to(tl.float32)
    w = tl.load(w_ptr + cols).to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(_scaled_row_sum(x * x, N) + eps)
    tl.store(out_ptr + row * N + cols, weighted_norm(x, inv_rms, w, tl.float32))
    tl.store(mean_ptr + row, _scaled_row_sum(x, N))


def _language_members() -> dict[str, object]:
    """The builtins of the language's modules and its tensor's methods (not the tensor's
    dunders: the interpreter gives tl.tensor a __repr__ for good at its first launch, as
    shipped too)."""
    modules = {"tl": tl, "core": tl.core, "math": tl.math, "tensor": tl.tensor}
    return {
        f"{m}.{k}": v
        for m, mod in modules.items()
        for k, v in vars(mod).items()
        if not (m == "tensor" and k.startswith("__"))
    }


def test_a_kernel_calling_helpers_computes_as_torch_and_leaves_the_language_as_it_was():
    assert swap_once_a_launch()  # installed when rollout_kernels was imported; idempotent
    before = _language_members()
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=gen), torch.randn(32, generator=gen)
    out, mean = torch.empty_like(x), torch.empty(5)
    for _ in range(2):  # a second launch swaps in the interpreter's builtins again
        _norm_kernel[(5,)](x, w, out, mean, 1e-6, N=32)
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mean, x.mean(-1), rtol=1e-5, atol=1e-6)
        after = _language_members()
        assert [k for k in before.keys() | after.keys() if after.get(k) is not before.get(k)] == []
