"""Device parameters for tests that run on the host and, where there is one, on a GPU."""

from __future__ import annotations

import pytest
import torch

# The CUDA case is marked gpu and skips without a GPU.
CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]
