"""MemoryOccupation: release and resume the engine's memory by tag (weights, kv_cache, cuda_graph).

On a GPU with torch-memory-saver, a release frees the tag's physical memory and keeps its
virtual addresses (CUDA graphs stay valid); resume re-backs it, with the weights' values only
with `enable_weights_cpu_backup`: then a release first copies the weights into one pinned host
buffer (allocated once, at start) and resume copies them back, each at host-link speed
(torch-memory-saver's own backup copies through pageable memory, several times slower: see
benchmarks/RESULTS.md). On the host the KV pool is freed and re-allocated and
the weights stay, so the same calls work (and CI covers them) anywhere. On a GPU without the
package nothing is given back: a re-allocated pool would move under the captured CUDA graphs.

Requests in flight are retracted when the KV cache goes and re-prefill after resume; while
anything is released, stepping is held and new requests wait.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rollout.errors import InvalidRequest
from rollout.forward.memory_regions import TAGS
from rollout.weight_sync.engine_port import EnginePort, WeightModel

logger = logging.getLogger(__name__)

HOLD = "memory_released"


def check_tags(tags: Any) -> list[str]:
    """The tags to act on: all three for None, else a non-empty list of known tags."""
    if tags is None:
        return list(TAGS)
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)) or not tags:
        raise InvalidRequest(
            f"tags must be None or a non-empty list of {', '.join(TAGS)}, got {tags!r}"
        )
    bad = [t for t in tags if t not in TAGS]
    if bad:
        raise InvalidRequest(f"memory tags must be among {', '.join(TAGS)}, got {bad}")
    return [t for t in TAGS if t in tags]


class PinnedWeightCopy:
    """The model's parameters mirrored in one pinned host buffer: `save` before their device
    memory is released, `restore` once it is back. Tied parameters are copied once."""

    def __init__(self, model: WeightModel) -> None:
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
    def __init__(self, engine: EnginePort, weights_cpu_backup: bool) -> None:
        self.engine = engine
        # Only where a release really gives the weights' memory back is a copy needed.
        self.weight_copy: PinnedWeightCopy | None = None
        if weights_cpu_backup and engine.releases_memory:
            self.weight_copy = PinnedWeightCopy(engine.model)
        self.released: set[str] = set()
        # Model buffers (rotary frequencies) are no weights a trainer pushes: kept on the host
        # across a release of the weights region, put back on resume.
        self._buffers: dict[str, torch.Tensor] = {}
        self.weights_lost = False  # the weights' memory was given back without a copy

    def release(self, tags: list[str]) -> dict[str, Any]:
        """Releases the tags not yet released (InvalidRequest when all of them are). Returns
        what happened."""
        engine = self.engine
        todo = [t for t in tags if t not in self.released]
        if not todo:
            raise InvalidRequest(f"nothing to release: {', '.join(tags)} already released")
        if engine.device.type == "cuda" and not engine.releases_memory:
            logger.warning("torch-memory-saver is not installed: releasing keeps the GPU memory")
        retracted = 0
        engine.hold(HOLD)
        if "kv_cache" in todo:
            retracted = engine.retract_all()
            engine.flush_prefix_cache()  # the retracted requests' KV goes with the pool
            engine.release_region("kv_cache")
        if "weights" in todo:
            named = engine.model.named_buffers()
            self._buffers = {n: b.detach().to("cpu", copy=True) for n, b in named}
            if self.weight_copy is not None:
                self.weight_copy.save()
            if engine.release_region("weights") and self.weight_copy is None:
                self.weights_lost = True
        if "cuda_graph" in todo:
            engine.release_region("cuda_graph")
        self.released.update(todo)
        return {"released": todo, "retracted_requests": retracted}

    def resume(self, tags: list[str]) -> dict[str, Any]:
        """Resumes the released tags among `tags` (InvalidRequest when none is). `weights_lost` in
        the result: the weights came
        back without their values, and must be pushed before generation continues."""
        engine = self.engine
        todo = [t for t in tags if t in self.released]
        if not todo:
            raise InvalidRequest(f"nothing to resume: {', '.join(tags)} not released")
        lost = False
        if "weights" in todo:
            engine.resume_region("weights")
            if self.weight_copy is not None:
                self.weight_copy.restore()
            with torch.no_grad():
                for name, saved in self._buffers.items():
                    engine.model.get_buffer(name).copy_(saved)
            self._buffers = {}
            lost, self.weights_lost = self.weights_lost, False
        if "kv_cache" in todo:
            engine.resume_region("kv_cache")
        if "cuda_graph" in todo:
            engine.resume_region("cuda_graph")
        self.released.difference_update(todo)
        if not self.released:
            engine.release_hold(HOLD)
        return {"resumed": todo, "weights_lost": lost}

    def info(self) -> dict[str, Any]:
        return {
            "memory_released": sorted(self.released),
            "kv_cache_bytes": 0 if "kv_cache" in self.released else self.engine.kv_cache_bytes,
        }
