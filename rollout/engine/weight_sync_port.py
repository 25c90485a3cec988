"""The weight-sync layer's ports into the engine: what a weight call may touch, and nothing else.

`SchedulerPort` is rank 0's EnginePort, over the Scheduler and the ModelRunner; `RunnerPort` is
another tensor-parallel rank's, over its ModelRunner alone (it schedules nothing: holds, aborts
and versions are rank 0's); `RanksPort` is rank 0's line to the other ranks (tp_setup.OtherRanks)
as weight_sync.rank_sync.OtherRanks. The one place that knows which attributes a weight call
touches: if they move, this file changes and the weight-sync layer does not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from rollout.engine.messages import AbortRequest
from rollout.forward import memory_regions
from rollout.weight_sync.deferred import in_thread
from rollout.weight_sync.engine_port import AdapterPort, EnginePort, WeightModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rollout.engine.model_runner import ModelRunner
    from rollout.engine.scheduler import Scheduler
    from rollout.engine.tp_follower import RankReply
    from rollout.engine.tp_setup import OtherRanks


class RunnerPort(EnginePort):
    """A rank's model and memory regions. Alone (a rank other than 0) it has no requests:
    holding, retracting and flushing are rank 0's, and do nothing here."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

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
        return ""

    # ---- generation ---------------------------------------------------------------------------
    def hold(self, reason: str) -> None:
        pass

    def release_hold(self, reason: str) -> None:
        pass

    def held_by(self) -> list[str]:
        return []

    def count_requests(self) -> int:
        return 0

    def abort_all(self) -> None:
        pass

    def retract_all(self) -> int:
        return 0

    def publish_weight_version(self, version: str, weights_changed: bool) -> None:
        pass

    # ---- LoRA adapters (LoraManager is an AdapterPort) ------------------------------------------
    @property
    def adapters(self) -> AdapterPort | None:
        return self.runner.lora

    def publish_adapter_version(self, name: str, version: str | None) -> str:
        return ""

    # ---- memory -----------------------------------------------------------------------------
    def flush_prefix_cache(self) -> None:
        pass

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


class SchedulerPort(RunnerPort):
    """Rank 0's: the runner's model and regions, and the Scheduler's requests and versions."""

    def __init__(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        super().__init__(runner)
        self.scheduler = scheduler

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

    def publish_adapter_version(self, name: str, version: str | None) -> str:
        return self.scheduler.publish_adapter_version(name, version)

    # ---- memory -----------------------------------------------------------------------------
    def flush_prefix_cache(self) -> None:
        self.scheduler.kv.flush()


class RanksPort:
    """weight_sync.rank_sync.OtherRanks over rank 0's OtherRanks. `start` runs the call on a
    thread: the weight call that started it (on the scheduler's thread) does its own part
    meanwhile and steps nothing, so the ranks' sockets are used by that thread alone."""

    def __init__(self, ranks: OtherRanks) -> None:
        self.ranks = ranks

    @property
    def size(self) -> int:
        return len(self.ranks.sockets) + 1

    def call(self, handler: str, *args: object) -> Sequence[RankReply]:
        return self.ranks.call(handler, *args)

    def start(self, handler: str, *args: object) -> Callable[[], Sequence[RankReply]]:
        future = in_thread(lambda: self.ranks.call(handler, *args), f"ranks-{handler}")
        return future.result
