"""Shared fixtures: tiny random checkpoints made on the fly (no model hub here).

Without CUDA, Triton's kernels run under its interpreter (TRITON_INTERPRET), which Triton reads
when a kernel module is first imported: set here, before any test module imports
`rollout_kernels`, so that no test's outcome depends on which test file a worker ran first.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from rollout.tiny_model import make_tiny_model  # noqa: E402


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
