"""SchedulerPort: the weight-sync layer's EnginePort over the Scheduler and the ModelRunner.

The one place that knows which of their attributes a weight call touches: if they move, this
file changes and the weight-sync layer does not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rollout.engine.messages import AbortRequest
from rollout.forward import memory_regions
from rollout.weight_sync.engine_port import EnginePort, WeightModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rollout.engine.model_runner import ModelRunner
    from rollout.engine.scheduler import Scheduler


class SchedulerPort(EnginePort):
    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        self.scheduler, self.runner = scheduler, runner

    @property
    def model(self) -> WeightModel:
        return self.runner.model

    @property
    def hf_config(self) -> PretrainedConfig:
        return self.runner.hf_config

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ---- generation ---------------------------------------------------------------------------
    def hold(self, reason: str) -> None:
        self.scheduler.holds.add(reason)

    def release_hold(self, reason: str) -> None:
        self.scheduler.holds.discard(reason)

    def held_by(self) -> list[str]:
        return sorted(self.scheduler.holds)

    def count_requests(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def abort_all(self) -> None:
        self.scheduler.abort(AbortRequest(abort_all=True))

    def retract_all(self) -> int:
        return self.scheduler.retract_all()

    def publish_weight_version(self, version: str, weights_changed: bool) -> None:
        self.scheduler.publish_weight_version(version, weights_changed)

    # ---- memory -----------------------------------------------------------------------------
    def flush_prefix_cache(self) -> None:
        self.scheduler.kv.flush()

    @property
    def releases_memory(self) -> bool:
        return memory_regions.is_releasable(self.runner.device)

    def release_region(self, tag: str) -> bool:
        released = memory_regions.release(tag, self.runner.device)
        if tag == "kv_cache" and not released and self.runner.device.type == "cpu":
            self.runner.kv_pool.free()
        return released

    def resume_region(self, tag: str) -> None:
        resumed = memory_regions.resume(tag, self.runner.device)
        if tag == "kv_cache" and not resumed and self.runner.device.type == "cpu":
            self.runner.kv_pool.allocate()

    @property
    def kv_cache_bytes(self) -> int:
        return self.runner.kv_pool.nbytes
