"""How the attention kernels' tl.dot multiplies, by the dtype of its operands."""

from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    """float32 tiles multiply in full float32 ("ieee"): Triton's default, TF32, keeps 10
    mantissa bits, too few for a float32 model to match the torch backend's greedy tokens.
    Half-precision operands use the tensor cores either way; the value is ignored for them."""
    return "ieee" if dtype == torch.float32 else "tf32"
