"""Host ints to the device without waiting for it."""

from __future__ import annotations

import torch


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 tensor of `values` on `device`. Non-blocking: a blocking copy from pageable memory
    would first wait for everything queued on the GPU."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)
