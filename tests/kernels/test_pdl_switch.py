"""Which launches use programmatic dependent launch: GPU tensors on a Hopper-or-later device
while the process's switch (the kernel plan's programmatic_launch, off with disable_pdl) is on;
never a CPU tensor (Triton's interpreter)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from rollout_kernels import pdl  # noqa: E402


def gpu_tensor(index: int = 0):
    return types.SimpleNamespace(is_cuda=True, device=types.SimpleNamespace(index=index))


@pytest.fixture
def restore_switch():
    # An engine started earlier in this process set the switch from its plan (off on a CPU).
    was = pdl._enabled
    yield
    pdl.set_enabled(was)


def test_gpu_launches_use_pdl_only_while_the_switch_is_on(monkeypatch, restore_switch):
    monkeypatch.setattr(pdl, "supported", lambda index: index == 0)  # GPU 0 a Hopper, GPU 1 not
    pdl.set_enabled(True)
    assert pdl.launch_options(gpu_tensor(0)) == {"USE_PDL": True, "launch_pdl": True}
    assert pdl.launch_options(gpu_tensor(1)) == {"USE_PDL": False}
    pdl.set_enabled(False)
    assert pdl.launch_options(gpu_tensor(0)) == {"USE_PDL": False}
    pdl.set_enabled(True)
    assert pdl.launch_options(gpu_tensor(0))["USE_PDL"]


def test_cpu_tensors_never_launch_with_pdl():
    assert pdl.launch_options(torch.zeros(2)) == {"USE_PDL": False}
