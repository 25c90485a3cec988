"""Tagged GPU memory regions (`weights`, `kv_cache`, `cuda_graph`) that can be released and resumed.

On a GPU with torch-memory-saver installed, tensors allocated inside `region(tag)` keep their
virtual addresses while their physical memory is released, so CUDA graphs captured over them stay
valid. Elsewhere (CPU, or the package missing) regions are plain allocations: the caller frees and
re-creates what it must (the KV pool) and keeps the rest (CPU weights).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache", "cuda_graph")

_saver: Any = None


def _memory_saver(device: torch.device) -> Any:
    """The torch-memory-saver singleton in hook mode "torch" (no LD_PRELOAD), or None."""
    global _saver
    if device.type != "cuda":
        return None
    if _saver is None:
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError:
            logger.info("torch-memory-saver is not installed: memory release keeps GPU memory")
            return None
        # NOTE: must be set before the first region() call, which initialises the hooks.
        torch_memory_saver.hook_mode = "torch"
        _saver = torch_memory_saver
        atexit.register(_exit_inside_a_region, torch_memory_saver)
    return _saver


def _exit_inside_a_region(saver: Any) -> None:
    """torch-memory-saver's hook ends the process with status 1 when memory it allocated is
    freed outside a region, which its pools (and the graphs') do as the interpreter tears them
    down: every GPU process that used a region exited with status 1 after finishing its work.
    At exit, frees on the main thread (where the teardown runs) count as inside a region."""
    impl = getattr(saver, "_impl", None)
    cdll = getattr(getattr(impl, "_binary_wrapper", None), "cdll", None)
    if cdll is None or not hasattr(cdll, "tms_set_interesting_region"):
        return  # not initialised (no region was used), or a version without the flag
    cdll.tms_set_interesting_region(True)


def is_releasable(device: torch.device) -> bool:
    """True when regions on `device` give their physical memory back on release."""
    return _memory_saver(device) is not None


@contextlib.contextmanager
def region(tag: str, device: torch.device) -> Iterator[None]:
    """Tensors allocated inside belong to `tag`'s region."""
    if tag not in TAGS:
        raise ValueError(f"memory region tag must be one of {', '.join(TAGS)}, got {tag!r}")
    saver = _memory_saver(device)
    if saver is None:
        yield
        return
    with saver.region(tag=tag):
        yield


@contextlib.contextmanager
def cuda_graph(
    graph: torch.cuda.CUDAGraph, pool: Any, stream: Any, device: torch.device
) -> Iterator[None]:
    """The context to capture `graph` in, so its private memory joins the `cuda_graph` region."""
    saver = _memory_saver(device)
    if saver is None:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
        return
    # torch-memory-saver 0.0.10's own cuda_graph() asserts hook_mode "preload". In "torch" mode
    # a capture allocates from the pool it is given, not from the region's: hand it a pool that
    # the saver's allocator serves, while the region's tag is set. All graphs share that pool
    # (the caller's `pool` stands for the same sharing without the saver).
    with saver.region(tag="cuda_graph"):
        with torch.cuda.graph(graph, pool=_releasable_graph_pool(device).id, stream=stream):
            yield


_graph_pools: dict[torch.device, Any] = {}


def _releasable_graph_pool(device: torch.device) -> Any:
    """A MemPool whose memory torch-memory-saver allocates (and so can release), per device."""
    if device not in _graph_pools:
        from torch_memory_saver.hooks.mode_torch import HookUtilModeTorch

        _graph_pools[device] = torch.cuda.MemPool(HookUtilModeTorch().get_allocator())
    return _graph_pools[device]


def release(tag: str, device: torch.device) -> bool:
    """Frees the physical memory of `tag`'s region; False when regions can't release here."""
    saver = _memory_saver(device)
    if saver is None:
        return False
    saver.pause(tag)
    return True


def resume(tag: str, device: torch.device) -> bool:
    """Re-backs `tag`'s region with physical memory (contents restored only with a CPU backup)."""
    saver = _memory_saver(device)
    if saver is None:
        return False
    saver.resume(tag)
    return True
