"""Shared fixtures: tiny random checkpoints made on the fly (no model hub here).

Without CUDA, Triton's kernels run under its interpreter (TRITON_INTERPRET), which Triton reads
when a kernel module is first imported: set here, before any test module imports
`rollout_kernels`, so that no test's outcome depends on which test file a worker ran first.

Each process's torch runs its CPU ops on one thread (OMP_NUM_THREADS, read by torch as it starts
here and in every engine, server or example process a test starts), unless the environment says
otherwise: the suite runs in two processes on two cores, the tiny models' ops are too small to
split, and threads of one op wait on descheduled ones whenever the cores are shared (an
example's rollouts ran 60x slower so; the suite, benchmarks/RESULTS.md, thirty-fourth session).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rollout.tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture
def packages(monkeypatch):
    """Pretend exactly the named packages import (for the kernel plan's backend checks)."""
    from rollout.forward import attention

    def set_importable(*names: str) -> None:
        monkeypatch.setattr(attention, "package_imports", lambda name: name in names)

    return set_importable


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen3_perturbed(tiny_qwen3, tmp_path_factory) -> str:
    """tiny_qwen3 with every weight moved by seeded noise: what a training step would push."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    gen = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=gen))
    path = str(tmp_path_factory.mktemp("tiny-qwen3-perturbed"))
    model.save_pretrained(path, safe_serialization=True)
    return path
