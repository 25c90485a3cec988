"""MemoryOccupation: release and resume the engine's memory by tag (weights, kv_cache, cuda_graph).

On a GPU with torch-memory-saver, a release frees the tag's physical memory and keeps its
virtual addresses (CUDA graphs stay valid); resume re-backs it, with the weights' values only
with `enable_weights_cpu_backup`: then a release first copies the weights into one pinned host
buffer (allocated once, at start) and resume copies them back, each at host-link speed
(torch-memory-saver's own backup copies through pageable memory: 8.4 s for 14 GiB). On the host the KV pool is freed and re-allocated and
the weights stay, so the same calls work (and CI covers them) anywhere. On a GPU without the
package nothing is given back: a re-allocated pool would move under the captured CUDA graphs.

Requests in flight are retracted when the KV cache goes and re-prefill after resume; while
anything is released, stepping is held and new requests wait.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rollout.forward import memory_regions
from rollout.forward.memory_regions import TAGS

logger = logging.getLogger(__name__)

HOLD = "memory_released"


def check_tags(tags: Any) -> list[str]:
    """The tags to act on: all three for None, else a non-empty list of known tags."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags:
        raise ValueError(f"tags must be None or a non-empty list of {', '.join(TAGS)}, got {tags!r}")
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise ValueError(f"memory tags must be among {', '.join(TAGS)}, got {bad}")
    return [t for t in TAGS if t in tags]


class PinnedWeightCopy:
    """The model's parameters mirrored in one pinned host buffer: `save` before their device
    memory is released, `restore` once it is back. Tied parameters are copied once."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p.data for p in model.parameters()]
        total = sum(p.numel() * p.element_size() for p in self.params)
        flat = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        self.host: list[torch.Tensor] = []
        offset = 0
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            self.host.append(flat[offset : offset + nbytes].view(p.dtype).view(p.shape))
            offset += nbytes
        self.nbytes = total

    def save(self) -> None:
        for device_param, host in zip(self.params, self.host):
            host.copy_(device_param, non_blocking=True)
        torch.cuda.synchronize()

    def restore(self) -> None:
        for device_param, host in zip(self.params, self.host):
            device_param.copy_(host, non_blocking=True)
        torch.cuda.synchronize()


class MemoryOccupation:
    def __init__(self, runner: Any, scheduler: Any, weights_cpu_backup: bool) -> None:
        self.runner = runner
        self.scheduler = scheduler
        # Only where a release really gives the weights' memory back is a copy needed.
        self.weight_copy: PinnedWeightCopy | None = None
        if weights_cpu_backup and memory_regions.is_releasable(runner.device):
            self.weight_copy = PinnedWeightCopy(runner.model)
        self.released: set[str] = set()
        # Model buffers (rotary frequencies) are no weights a trainer pushes: kept on the host
        # across a release of the weights region, put back on resume.
        self._buffers: dict[str, torch.Tensor] = {}
        self.weights_lost = False  # the weights' memory was given back without a copy

    @property
    def device(self) -> torch.device:
        return self.runner.device

    def release(self, tags: list[str]) -> dict[str, Any]:
        """Releases the tags not yet released. Returns what happened."""
        todo = [t for t in tags if t not in self.released]
        if todo and self.device.type == "cuda" and not memory_regions.is_releasable(self.device):
            logger.warning("torch-memory-saver is not installed: releasing keeps the GPU memory")
        retracted = 0
        self.scheduler.holds.add(HOLD)
        if "kv_cache" in todo:
            retracted = self.scheduler.retract_all()
            self.scheduler.kv.flush()  # the retracted requests' KV goes with the pool
            if not memory_regions.release("kv_cache", self.device) and self.device.type == "cpu":
                self.runner.kv_pool.free()
        if "weights" in todo:
            model = self.runner.model
            self._buffers = {n: b.detach().to("cpu", copy=True) for n, b in model.named_buffers()}
            if self.weight_copy is not None:
                self.weight_copy.save()
            if memory_regions.release("weights", self.device) and self.weight_copy is None:
                self.weights_lost = True
        if "cuda_graph" in todo:
            memory_regions.release("cuda_graph", self.device)
        self.released.update(todo)
        return {"released": todo, "retracted_requests": retracted}

    def resume(self, tags: list[str]) -> dict[str, Any]:
        """Resumes the released tags among `tags`. `weights_lost` in the result: the weights came
        back without their values, and must be pushed before generation continues."""
        todo = [t for t in tags if t in self.released]
        lost = False
        if "weights" in todo:
            memory_regions.resume("weights", self.device)
            if self.weight_copy is not None:
                self.weight_copy.restore()
            with torch.no_grad():
                for name, saved in self._buffers.items():
                    self.runner.model.get_buffer(name).copy_(saved)
            self._buffers = {}
            lost, self.weights_lost = self.weights_lost, False
        if "kv_cache" in todo:
            if not memory_regions.resume("kv_cache", self.device) and self.device.type == "cpu":
                self.runner.kv_pool.allocate()
        if "cuda_graph" in todo:
            memory_regions.resume("cuda_graph", self.device)
        self.released.difference_update(todo)
        if not self.released:
            self.scheduler.holds.discard(HOLD)
        return {"resumed": todo, "weights_lost": lost}

    def info(self) -> dict[str, Any]:
        return {
            "memory_released": sorted(self.released),
            "kv_cache_bytes": 0 if "kv_cache" in self.released else self.runner.kv_pool.nbytes,
        }
