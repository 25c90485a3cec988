"""Programmatic dependent launch (PDL): a kernel gets its SMs while the kernel before it ends.

On Hopper and later a kernel launched with PDL is scheduled once every program of the kernel
before it has signalled (`gdc_launch_dependents`), not when that kernel has finished and its
writes have been flushed; its programs then wait (`gdc_wait`) for that completion. A small
decode step is hundreds of short kernels (benchmarks/RESULTS.md counts them), each paying a
launch and a ramp-up after the one before it drains; with PDL those overlap the previous
kernel's tail (benchmarks/RESULTS.md measures the gain, and the loss of a skinny GEMM that asked
L2 for its weight before waiting).

The contract every kernel launched with `launch_options` keeps: it calls `pdl_start` before it
reads anything an earlier kernel may have written and before any store. Each kernel then
finishes only after the one before it has, so whatever a kernel reads, every kernel launched
before it has finished writing, however many PDL kernels stand between them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_enabled = True  # the process's switch: KernelPlan.programmatic_launch


def set_enabled(flag: bool) -> None:
    """Turns PDL on or off for every launch after this one (the model runner sets it from the
    kernel plan before its first forward)."""
    global _enabled
    _enabled = flag


@functools.cache
def supported(device_index: int) -> bool:
    """Whether the GPU `device_index` can launch with PDL (compute capability 9.0 or later)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_options(t: torch.Tensor) -> dict[str, bool]:
    """The launch keywords of a kernel whose `USE_PDL` constexpr guards `pdl_start`, for a launch
    on t's device: with PDL where the switch is on and the device supports it."""
    if not (_enabled and t.is_cuda):
        return {"USE_PDL": False}
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return {"USE_PDL": True, "launch_pdl": True} if supported(index) else {"USE_PDL": False}


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    """Lets the next kernel be scheduled, then waits for the previous kernel to finish."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
