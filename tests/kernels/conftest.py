"""Kernel tests run compiled on a CUDA GPU, else under Triton's interpreter on CPU tensors.

TRITON_INTERPRET is read when a kernel is decorated (when its module is imported), so it is
set here, before any test module of this folder imports `rollout_kernels`. Only without CUDA:
a GPU run must compile the kernels, and no one runs Triton on CPU tensors otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
