"""Kernel tests run compiled on a CUDA GPU, else under Triton's interpreter on CPU tensors
(tests/conftest.py sets TRITON_INTERPRET without CUDA, before any kernel module is imported)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
