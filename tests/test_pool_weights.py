"""The pool's all-or-nothing weight fan-out and its restores, on fake replicas (no Ray, no
engines): what each replica ends up serving when one refuses, cannot drop its stage, fails at
apply time, or restarts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rollout.errors import InvalidRequest
from rollout.pool.replica import Replica
from rollout.pool.router import Router
from rollout.pool.supervisor import Supervisor
from rollout.pool.weight_source import WeightSource
from rollout.pool.weights import Group, PoolWeights

UPDATES = (
    "update_weights_from_disk",
    "update_weights_from_distributed",
    "update_weights_from_tensor",
)


class FakeReplica(Replica):
    """An engine's weight-call semantics in a few lines: while paused an update stages, and
    continue applies what is staged under the last label."""

    def __init__(self, index: int) -> None:
        self.index, self.name = index, f"replica {index}"
        self.version, self.weights, self.staged = "default", "base", None
        self.paused, self.starts = False, 0
        self.released: set[str] = set()
        self.refuse: set[str] = set()  # methods that raise InvalidRequest
        self.hang: set[str] = set()  # methods that never answer (a stopped process)
        self.cannot_discard = self.fail_apply = False
        self.calls: list[str] = []

    async def start(self) -> dict:
        self.starts += 1
        self.version, self.weights, self.staged, self.paused = "default", "base", None, False
        self.released, self.hang = set(), set()
        self.cannot_discard = self.fail_apply = False
        return {"weight_version": "default", "dtype": "float32", "tp_size": 1}

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(method)
        if method in self.hang:
            await asyncio.Event().wait()
        if method in self.refuse:
            self.staged = None  # a refused update takes the staged ones down with it
            raise InvalidRequest(f"{method} refused")
        if method in UPDATES:
            weights = args[0] if method == "update_weights_from_disk" else method
            self.loaded = args[0] if method == "update_weights_from_tensor" else None
            if self.paused:
                self.staged = (weights, kwargs["weight_version"])
                return {"success": True, "staged": True}
            self.weights, self.version = weights, kwargs["weight_version"]
            return {"success": True, "weight_version": self.version}
        return await getattr(self, method)(*args, **kwargs)

    async def pause_generation(self, mode: str) -> dict:
        self.paused = True
        return {"success": True}

    async def continue_generation(self) -> dict:
        staged, self.staged, self.paused = self.staged, None, False
        if staged is None:
            return {"success": True}
        if self.fail_apply:
            raise RuntimeError("out of memory while applying")
        self.weights, self.version = staged
        return {"success": True, "weight_version": self.version}

    async def discard_staged_weights(self) -> dict:
        if self.cannot_discard:
            raise AttributeError("no discard_staged_weights")
        self.staged = None
        return {"success": True}

    async def get_weight_version(self) -> str:
        return self.version

    async def update_weight_version(
        self, new_version: str, abort_all_requests: bool = False
    ) -> dict:
        self.version = new_version
        return {"success": True}

    async def release_memory_occupation(self, tags: tuple[str, ...]) -> dict:
        if set(tags) <= self.released:  # as the engine: refused only when none is left
            raise InvalidRequest(f"nothing to release: {sorted(tags)} already released")
        self.released |= set(tags)
        return {"success": True}

    async def resume_memory_occupation(self, tags: tuple[str, ...]) -> dict:
        if not set(tags) & self.released:
            raise InvalidRequest(f"nothing to resume: {sorted(tags)} not released")
        self.released -= set(tags)
        return {"success": True}

    async def alive(self) -> bool:
        return True

    async def stop(self) -> None:
        pass


def _pool(count: int = 3, **source: Any) -> tuple[list[FakeReplica], Supervisor, PoolWeights]:
    replicas = [FakeReplica(i) for i in range(count)]
    sup = Supervisor(replicas, Router(count), health_check_s=0)
    weights = PoolWeights(sup, WeightSource("default", torch.float32, **source))
    sup.restore = weights.restore
    return replicas, sup, weights


async def _settle(sup: Supervisor) -> None:
    for _ in range(100):
        if all(s in ("serving", "stale") for s in sup.state):
            return
        await asyncio.sleep(0.01)


def _disk(weights: PoolWeights, path: str, version: str | None = None) -> Any:
    return weights.update("update_weights_from_disk", (path,), {"load_format": None}, version)


def test_every_replica_commits_one_label():
    async def run() -> None:
        replicas, sup, weights = _pool()
        await sup.start_all()
        assert (await _disk(weights, "/ckpt/a"))["weight_version"] == "default"  # label kept
        assert (await _disk(weights, "/ckpt/b", "step-1"))["weight_version"] == "step-1"
        assert (await _disk(weights, "/ckpt/c"))["weight_version"] == "step-1"
        assert {(r.weights, r.version, r.paused) for r in replicas} == {
            ("/ckpt/c", "step-1", False)
        }

    asyncio.run(run())


def test_one_refusal_drops_the_update_everywhere():
    async def run() -> None:
        replicas, sup, weights = _pool()
        await sup.start_all()
        replicas[1].refuse.add("update_weights_from_disk")
        with pytest.raises(
            ValueError, match="replica 1: update_weights_from_disk refused; the update was dropped"
        ):
            await _disk(weights, "/ckpt/new", "v1")
        assert [(r.weights, r.version, r.staged, r.paused) for r in replicas] == [
            ("base", "default", None, False)
        ] * 3
        assert weights.source.version == "default" and sup.serving() == [0, 1, 2]

    asyncio.run(run())


def test_a_replica_that_cannot_drop_its_stage_is_restarted_on_the_old_weights():
    async def run() -> None:
        replicas, sup, weights = _pool()
        await sup.start_all()
        await _disk(weights, "/ckpt/old", "old")
        replicas[0].refuse.add("update_weights_from_disk")
        replicas[2].cannot_discard = True
        with pytest.raises(ValueError):
            await _disk(weights, "/ckpt/new", "new")
        await _settle(sup)
        assert replicas[2].starts == 2 and sup.state == ["serving"] * 3
        assert [(r.weights, r.version) for r in replicas] == [("/ckpt/old", "old")] * 3

    asyncio.run(run())


def test_a_replica_failing_at_apply_time_is_restarted_on_the_new_weights():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        replicas[1].fail_apply = True
        assert (await _disk(weights, "/ckpt/new", "new"))["weight_version"] == "new"
        await _settle(sup)
        assert replicas[1].starts == 2
        assert [(r.weights, r.version) for r in replicas] == [("/ckpt/new", "new")] * 2

    asyncio.run(run())


def test_a_replica_restarted_while_the_pool_is_released_is_released_too():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        await weights.pause("in_place")
        await weights.memory("release_memory_occupation", ("kv_cache", "weights"))
        sup.mark_dead(1, "killed")
        await _settle(sup)
        assert replicas[1].starts == 2
        assert [(r.released, r.paused) for r in replicas] == [({"kv_cache", "weights"}, True)] * 2
        await weights.memory("resume_memory_occupation", ("kv_cache", "weights"))
        await weights.resume_generation()
        sup.mark_dead(0, "killed")
        await _settle(sup)
        assert replicas[0].starts == 2
        assert [(r.released, r.paused) for r in replicas] == [(set(), False)] * 2

    asyncio.run(run())


def test_a_replica_restarted_while_the_pool_is_paused_stages_the_updates_staged_since():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        await weights.pause("in_place")
        await _disk(weights, "/ckpt/a", "a")
        sup.mark_dead(1, "killed")
        await _settle(sup)
        assert (replicas[1].paused, replicas[1].staged) == (True, ("/ckpt/a", "a"))
        assert (await weights.resume_generation())["weight_version"] == "a"
        await _settle(sup)
        # It applied the update with the others, not restarted once more for lacking it.
        assert replicas[1].starts == 2 and sup.serving() == [0, 1]
        assert [(r.weights, r.version, r.paused) for r in replicas] == [("/ckpt/a", "a", False)] * 2

    asyncio.run(run())


def test_a_memory_call_one_replica_refuses_is_undone_on_the_others_for_its_tags():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        await weights.memory("release_memory_occupation", ("weights",))
        replicas[1].refuse.add("release_memory_occupation")
        with pytest.raises(ValueError, match="replica 1"):
            await weights.memory("release_memory_occupation", ("kv_cache", "weights"))
        # Replica 0 gave kv_cache back again; its weights stay released, as the pool's are.
        assert [r.released for r in replicas] == [{"weights"}] * 2
        replicas[1].refuse = {"resume_memory_occupation"}
        with pytest.raises(ValueError, match="replica 1"):
            await weights.memory("resume_memory_occupation", ("weights",))
        # Replica 0 released its weights again, so a retry resumes both (it used to refuse the
        # retry, finding nothing to resume, while the pool held its weights as released).
        assert [r.released for r in replicas] == [{"weights"}] * 2
        replicas[1].refuse.clear()
        await weights.memory("resume_memory_occupation", ("weights",))
        assert [r.released for r in replicas] == [set()] * 2 and weights.released == set()

    asyncio.run(run())


def test_a_replica_restarted_stale_while_the_pool_is_released_is_released_too():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        weights.groups["g"] = Group((0, 0))
        names = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
        await weights.update("update_weights_from_distributed", (), names, "dist")
        await weights.memory("release_memory_occupation", ("kv_cache", "weights"))
        sup.mark_dead(1, "killed")  # back with no copy of the broadcast weights: stale
        await _settle(sup)
        assert sup.state == ["serving", "stale"]
        assert [r.released for r in replicas] == [{"kv_cache", "weights"}] * 2
        # The pool's resume finds it released too (it was refused there: nothing to resume).
        await weights.memory("resume_memory_occupation", ("kv_cache", "weights"))
        assert [r.released for r in replicas] == [set()] * 2

    asyncio.run(run())


def test_a_replica_hung_in_an_update_holds_it_only_until_found_dead():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        replicas[1].hang.add("update_weights_from_disk")
        update = asyncio.ensure_future(_disk(weights, "/ckpt/new", "new"))
        await asyncio.sleep(0.1)
        assert not update.done() and replicas[0].paused  # waiting on replica 1
        sup.mark_dead(1, "it failed a health check")  # what the health check does
        with pytest.raises(RuntimeError, match="replica 1 went down during update_weights_from_disk"):
            await asyncio.wait_for(update, 5)
        assert (replicas[0].weights, replicas[0].version, replicas[0].paused) == ("base", "default", False)
        await _settle(sup)
        assert replicas[1].starts == 2 and sup.serving() == [0, 1]
        assert [r.version for r in replicas] == ["default"] * 2

    asyncio.run(run())


def test_a_partial_pause_is_undone():
    async def run() -> None:
        replicas, sup, weights = _pool()
        await sup.start_all()
        replicas[2].refuse.add("pause_generation")
        with pytest.raises(ValueError, match="replica 2"):
            await weights.pause("retract")
        assert [r.paused for r in replicas] == [False] * 3 and weights.paused is None

    asyncio.run(run())


def test_updates_while_the_pool_is_paused_apply_at_its_continue():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        await weights.pause("in_place")
        await _disk(weights, "/ckpt/a", "a")
        assert [r.version for r in replicas] == ["default"] * 2 and all(r.paused for r in replicas)
        assert (await weights.resume_generation())["weight_version"] == "a"
        assert [(r.weights, r.version, r.paused) for r in replicas] == [("/ckpt/a", "a", False)] * 2

    asyncio.run(run())


def test_a_refusal_while_paused_drops_every_update_staged_since_the_pause():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        await weights.pause("in_place")
        await _disk(weights, "/ckpt/a", "a")
        replicas[1].refuse.add("update_weights_from_disk")
        with pytest.raises(ValueError, match="every update staged since the pause was dropped"):
            await _disk(weights, "/ckpt/b")
        await weights.resume_generation()
        assert [(r.weights, r.version, r.paused) for r in replicas] == [
            ("base", "default", False)
        ] * 2
        assert weights.source.version == "default" and weights.source.disk is None

    asyncio.run(run())


def test_the_pool_counts_the_weight_changes_it_committed():
    """As one engine counts them (a continue applying staged updates is one change, a refused
    update none), and not reset by a replica's restart."""

    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        for path in ("/ckpt/a", "/ckpt/b", "/ckpt/c"):
            await _disk(weights, path)
        assert weights.weight_updates == 3
        await weights.pause("in_place")
        await _disk(weights, "/ckpt/d", "d")
        await _disk(weights, "/ckpt/e")
        await weights.resume_generation()
        assert weights.weight_updates == 4
        await weights.relabel("renamed", False)  # a new label, the same weights
        replicas[1].refuse.add("update_weights_from_disk")
        with pytest.raises(ValueError, match="refused"):
            await _disk(weights, "/ckpt/f")
        sup.mark_dead(0, "killed")
        await _settle(sup)
        assert replicas[0].starts == 2 and replicas[0].weights == "/ckpt/e"
        assert weights.weight_updates == 4

    asyncio.run(run())


def test_after_a_broadcast_a_restart_is_stale_until_a_checkpoint_comes():
    async def run() -> None:
        replicas, sup, weights = _pool(2)
        await sup.start_all()
        weights.groups["g"] = Group((0, 0))  # both joined in their first incarnation
        names = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
        await weights.update("update_weights_from_distributed", (), names, "dist")
        sup.mark_dead(1, "killed")
        await _settle(sup)
        assert sup.state == ["serving", "stale"] and sup.serving() == [0]
        with pytest.raises(RuntimeError, match="replica 1 restarted or went down"):
            await weights.update("update_weights_from_distributed", (), names, "dist-2")
        await _disk(weights, "/ckpt/d", "disk")
        assert sup.state == ["serving", "serving"]
        assert [(r.weights, r.version) for r in replicas] == [("/ckpt/d", "disk")] * 2

    asyncio.run(run())


def test_after_a_broadcast_restore_weights_gives_a_restart_the_trainers_weights():
    trainer = {"w": torch.ones(2, dtype=torch.float64)}

    async def run() -> None:
        replicas, sup, weights = _pool(2, restore_weights=lambda: trainer)
        await sup.start_all()
        weights.groups["g"] = Group((0, 0))
        names = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "g"}
        await weights.update("update_weights_from_distributed", (), names, "dist")
        sup.mark_dead(0, "killed")
        await _settle(sup)
        assert sup.state == ["serving", "serving"] and replicas[0].starts == 2
        assert (replicas[0].weights, replicas[0].version) == ("update_weights_from_tensor", "dist")
        [(name, tensor)] = replicas[0].loaded
        assert name == "w" and tensor.dtype == torch.float32 and tensor.device.type == "cpu"

    asyncio.run(run())


class AdapterReplica(FakeReplica):
    """A FakeReplica that loads and unloads LoRA adapters by name."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.adapters: dict[str, str] = {}

    async def start(self) -> dict:
        self.adapters = {}
        return await super().start()

    async def load_lora_adapter(self, lora_name: str, lora_path: str, allowed_roots=None) -> dict:
        self.adapters[lora_name] = lora_path
        return {"success": True, "lora_adapters": dict(self.adapters)}

    async def unload_lora_adapter(self, lora_name: str) -> dict:
        del self.adapters[lora_name]
        return {"success": True, "lora_adapters": dict(self.adapters)}


def _adapter_pool():
    from rollout.pool.adapters import PoolAdapters

    replicas = [AdapterReplica(i) for i in range(3)]
    sup = Supervisor(replicas, Router(3), health_check_s=0)
    weights = PoolWeights(sup, WeightSource("default", torch.float32))
    adapters = PoolAdapters(sup, weights)

    sup.restore = weights.restore  # the pool's weights, then its adapters
    return replicas, sup, adapters


def test_an_adapter_loads_on_every_replica_or_on_none_and_comes_back_after_a_restart():
    async def run() -> None:
        replicas, sup, adapters = _adapter_pool()
        await sup.start_all()
        assert (await adapters.load("math", "/a/math"))["replicas"] == 3
        assert [r.adapters for r in replicas] == [{"math": "/a/math"}] * 3
        replicas[2].refuse.add("load_lora_adapter")
        with pytest.raises(InvalidRequest, match="replica 2: load_lora_adapter refused.*undone"):
            await adapters.load("code", "/a/code")
        assert [r.adapters for r in replicas] == [{"math": "/a/math"}] * 3  # code unloaded again
        replicas[2].refuse.clear()
        replicas[1].refuse.add("unload_lora_adapter")  # a request there still uses it
        with pytest.raises(InvalidRequest, match="unload_lora_adapter refused"):
            await adapters.unload("math")
        assert [r.adapters for r in replicas] == [{"math": "/a/math"}] * 3  # loaded back
        sup.mark_dead(0, "killed")
        await sup.wait_serving(5)
        for _ in range(100):
            if sup.serving() == [0, 1, 2]:
                break
            await asyncio.sleep(0.05)
        assert replicas[0].starts == 2 and replicas[0].adapters == {"math": "/a/math"}

    asyncio.run(run())
