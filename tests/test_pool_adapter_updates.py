"""LoRA adapter weight updates through a pool (CPU, float32, tiny Qwen3): a PEFT directory and a
gloo broadcast reach every replica, which then serve PEFT's greedy tokens of the new adapter
under one label; an update one replica refuses leaves every replica on the adapter's previous
values and label; a replica that restarts serves the adapter's latest values (or, after a
broadcast the pool holds no copy of, stays out of traffic until an update it can copy).

The replicas are engines of this process behind the pool's Replica interface (no Ray, no
HTTP: the pool's logic is the same), plus a few cases on fake replicas."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import torch
from hf_reference import greedy_of
from lora_helpers import make_peft_adapter, peft_model
from pool_helpers import free_port, wait_for
from safetensors.torch import load_file

from rollout import RolloutEngine
from rollout.engine.tokenizer_manager import EngineDeadError
from rollout.errors import InvalidRequest
from rollout.pool import PoolOptions, RolloutPool
from rollout.pool.replica import Replica, ReplicaDead

pytest.importorskip("peft")

NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
PROMPT = list(range(60, 90))
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


class EngineReplica(Replica):
    """A RolloutEngine of this process as a pool replica; start() makes a fresh one."""

    def __init__(self, index: int, model: str, options: dict[str, Any]) -> None:
        self.index, self.name = index, f"replica {index}"
        self.model, self.options = model, options
        self.engine: RolloutEngine | None = None
        self.starts = 0

    async def start(self) -> dict:
        await self.stop()
        self.engine = await asyncio.to_thread(RolloutEngine, self.model, **self.options)
        self.starts += 1
        return await asyncio.to_thread(self.engine.get_server_info)

    def _live(self) -> RolloutEngine:
        if self.engine is None or not self.engine.is_alive():
            raise ReplicaDead(f"{self.name} is not running")
        return self.engine

    async def generate(self, request: Any) -> Any:
        try:
            return await self._live().async_generate(request)
        except EngineDeadError as e:
            raise ReplicaDead(str(e)) from None

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(getattr(self._live(), method), *args, **kwargs)
        except EngineDeadError as e:
            raise ReplicaDead(str(e)) from None

    async def alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    async def stop(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.to_thread(engine.shutdown)


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    """Adapter "a" is loaded at start; "b", "c" are a trainer's new values of its layout;
    "big" has rank 8, which replica 1 (max_lora_rank 4) refuses."""
    root = tmp_path_factory.mktemp("pool-lora")
    made = {
        name: make_peft_adapter(tiny_qwen3, str(root / name), 4, 8, TARGETS, seed=40 + i)
        for i, name in enumerate("abc")
    }
    made["big"] = make_peft_adapter(tiny_qwen3, str(root / "big"), 8, 16, ["q_proj"], seed=9)
    return made


@pytest.fixture(scope="module")
def expected(tiny_qwen3, adapters) -> dict[str, list[int]]:
    return {
        name: greedy_of(peft_model(tiny_qwen3, adapters[name]), [PROMPT], NEW)[0]
        for name in ("a", "b", "c")
    }


@pytest.fixture(scope="module")
def pool(tiny_qwen3, adapters):
    base = {
        "device": "cpu", "dtype": "float32", "max_total_tokens": 1024,
        "lora_paths": [f"a={adapters['a']}"], "max_loras_per_batch": 1,
    }  # fmt: skip
    replicas = [
        EngineReplica(0, tiny_qwen3, {**base, "max_lora_rank": 8}),
        EngineReplica(1, tiny_qwen3, {**base, "max_lora_rank": 4}),
    ]
    p = RolloutPool.__new__(RolloutPool)
    p._ray_group, p._owns_ray = None, False
    p._open(replicas, tiny_qwen3, {}, PoolOptions(health_check_s=0.3, wait_for_replica_s=60))
    try:
        yield p
    finally:
        p.shutdown()


def _each(pool) -> list[tuple[list[int], str]]:
    """Each replica's own greedy tokens on adapter "a", and the label they carry."""
    outs = [
        pool.replica_call(i, "generate", input_ids=PROMPT, sampling_params=GREEDY, lora_path="a")
        for i in range(2)
    ]
    return [(o["output_ids"], o["meta_info"]["weight_version"]) for o in outs]


def _versions(pool) -> list[str]:
    return [pool.replica_call(i, "get_server_info")["lora_weight_versions"]["a"] for i in (0, 1)]


def test_a_disk_update_reaches_every_replica(pool, adapters, expected):
    assert _each(pool) == [(expected["a"], "default")] * 2
    result = pool.update_weights_from_disk(adapters["b"], weight_version="b-1", lora_name="a")
    assert result["weight_version"] == "b-1" and result["replicas"] == 2
    assert _each(pool) == [(expected["b"], "b-1")] * 2
    out = pool.generate(input_ids=PROMPT, sampling_params=GREEDY, lora_path="a")
    assert out["output_ids"] == expected["b"] and out["meta_info"]["weight_version"] == "b-1"
    info = pool.get_server_info()
    assert info["lora_weight_versions"] == {"a": "b-1"}
    assert "lora_weight_versions_differ" not in info
    assert pool.get_weight_version() == "default"  # the base model's label is its own


def test_an_update_one_replica_refuses_changes_no_replica(pool, adapters, expected):
    with pytest.raises(InvalidRequest, match="replica 1.*rank 8 is above max_lora_rank 4"):
        pool.update_weights_from_disk(adapters["big"], weight_version="never", lora_name="a")
    assert _each(pool) == [(expected["b"], "b-1")] * 2  # replica 0 dropped what it staged
    assert pool.get_server_info()["lora_weight_versions"] == {"a": "b-1"}


def test_the_http_front_of_a_pool_forwards_an_adapter_update(pool, adapters, expected):
    """`rollout router` is rollout serve's app over the pool: its admin routes reach it."""
    from fastapi.testclient import TestClient

    from rollout.server.app import create_app
    from rollout.server.options import ServerOptions

    roots = (os.path.dirname(adapters["a"]),)
    with TestClient(create_app(pool, ServerOptions(allowed_weight_roots=roots))) as http:
        body = {"model_path": adapters["a"], "weight_version": "http-1", "lora_name": "a"}
        answer = http.post("/update_weights_from_disk", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["weight_version"] == "http-1"
        assert http.get("/get_server_info").json()["lora_weight_versions"] == {"a": "http-1"}
    assert _each(pool) == [(expected["a"], "http-1")] * 2


def test_a_tensor_update_of_the_adapter_reaches_both_replicas(pool, adapters, expected):
    named = load_file(os.path.join(adapters["b"], "adapter_model.safetensors"))
    result = pool.update_weights_from_tensor(named, weight_version="t-1", lora_name="a")
    assert result["weight_version"] == "t-1"
    assert _each(pool) == [(expected["b"], "t-1")] * 2
    assert pool.adapters.sources.entries["a"].tensors  # the copy a restart is given


def test_a_gloo_broadcast_of_the_adapter_reaches_both_replicas(pool, adapters, expected):
    from rollout.weight_sync.sender import WeightSender

    sender = WeightSender(pool, method="distributed")
    sender.init_group("127.0.0.1", free_port(), backend="gloo", group_name="lora", timeout_s=60)
    try:
        named = load_file(os.path.join(adapters["c"], "adapter_model.safetensors"))
        result = sender.push(named, weight_version="c-1", lora_name="a")
        assert result["weight_version"] == "c-1"
    finally:
        sender.close()
    assert _each(pool) == [(expected["c"], "c-1")] * 2
    assert pool.get_server_info()["lora_weight_versions"] == {"a": "c-1"}


def _kill(pool, i: int) -> None:
    pool.replicas[i].engine.shutdown()  # found by the pool's health check


def test_after_a_broadcast_a_restart_waits_for_an_update_the_pool_can_copy(
    pool, adapters, expected
):
    starts = pool.replicas[1].starts
    _kill(pool, 1)
    wait_for(lambda: pool.stats()["replicas"][1]["state"] == "stale", 60, "replica 1 not stale")
    reason = pool.stats()["replicas"][1]["reason"]
    assert "LoRA adapter 'a'" in reason and "update_weights_from_distributed" in reason
    assert pool.replicas[1].starts == starts + 1
    # It takes no traffic: the pool serves the broadcast values from replica 0 only.
    outs = pool.generate(input_ids=[PROMPT] * 2, sampling_params=GREEDY, lora_path=["a", "a"])
    assert [o["output_ids"] for o in outs] == [expected["c"]] * 2
    # A directory gives the pool a copy: replica 1 gets it too and serves again.
    pool.update_weights_from_disk(adapters["b"], weight_version="b-2", lora_name="a")
    assert pool.stats()["replicas"][1]["state"] == "serving"
    assert _each(pool) == [(expected["b"], "b-2")] * 2


def test_a_restarted_replica_serves_the_adapters_latest_values(pool, expected):
    starts = pool.replicas[0].starts
    _kill(pool, 0)
    wait_for(
        lambda: (
            pool.replicas[0].starts > starts and pool.stats()["replicas"][0]["state"] == "serving"
        ),
        60,
        "replica 0 not back",
    )
    # It started from lora_paths (adapter "a"'s first values); the pool gave it the last update.
    assert _each(pool) == [(expected["b"], "b-2")] * 2
    assert pool.get_server_info()["lora_weight_versions"] == {"a": "b-2"}


# ---- fake replicas: what each one ends up serving ------------------------------------------
class FakeAdapters(Replica):
    """An engine's adapter semantics in a few lines: adapter -> [values, label]; while paused
    an update stages, continue applies what is staged."""

    def __init__(self, index: int) -> None:
        self.index, self.name = index, f"replica {index}"
        self.refuse: set[str] = set()
        self.starts = 0
        self.start_sync()

    def start_sync(self) -> None:
        self.adapters = {"a": ["/a", "default"]}  # its lora_paths
        self.staged: list[tuple[str, str, str]] = []
        self.paused = False

    async def start(self) -> dict:
        self.starts += 1
        self.start_sync()
        return {"weight_version": "default", "dtype": "float32", "tp_size": 1}

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method in self.refuse:
            raise InvalidRequest(f"{method} refused")
        if method.startswith("update_weights_from_"):
            values = {
                "update_weights_from_disk": lambda: args[0],
                "update_weights_from_distributed": lambda: f"dist:{kwargs['weight_version']}",
                "update_weights_from_tensor": lambda: f"tensors:{sorted(dict(args[0]))}",
            }[method]()
            update = (kwargs["lora_name"], values, kwargs["weight_version"])
            if self.paused:
                self.staged.append(update)
                return {"staged": True}
            self.adapters[update[0]] = [values, update[2]]
            return {"weight_version": update[2]}
        return getattr(self, method)(*args, **kwargs)

    def pause_generation(self, mode: str) -> dict:
        self.paused = True
        return {"success": True}

    def continue_generation(self) -> dict:
        for name, values, version in self.staged:
            self.adapters[name] = [values, version]
        versions = {name: self.adapters[name][1] for name, _, _ in self.staged}
        self.staged, self.paused = [], False
        return {"success": True, **({"lora_weight_versions": versions} if versions else {})}

    def discard_staged_weights(self) -> dict:
        self.staged = []
        return {"success": True}

    def load_lora_adapter(self, name: str, path: str, allowed_roots=None) -> dict:
        self.adapters[name] = [path, "default"]
        return {"success": True}

    def unload_lora_adapter(self, name: str) -> dict:
        del self.adapters[name]
        return {"success": True}

    def get_weight_version(self) -> str:
        return "default"

    async def alive(self) -> bool:
        return True

    async def stop(self) -> None:
        pass


def _fake_pool(restore_adapter=None):
    from rollout.pool.adapter_source import AdapterSources
    from rollout.pool.adapters import PoolAdapters
    from rollout.pool.router import Router
    from rollout.pool.supervisor import Supervisor
    from rollout.pool.weight_source import WeightSource
    from rollout.pool.weights import PoolWeights

    replicas = [FakeAdapters(0), FakeAdapters(1)]
    sup = Supervisor(replicas, Router(2), health_check_s=0)
    sources = AdapterSources(restore_adapter)
    sources.started_with({"a": "default"})
    weights = PoolWeights(sup, WeightSource("default", torch.float32), sources)
    sup.restore = weights.restore
    return replicas, sup, weights, PoolAdapters(sup, weights)


def _disk(weights, path: str, version: str | None, name: str = "a") -> Any:
    kwargs = {"load_format": None, "lora_name": name}
    return weights.update("update_weights_from_disk", (path,), kwargs, version)


async def _back(sup, i: int) -> None:
    for _ in range(200):
        if sup.state[i] in ("serving", "stale"):
            return
        await asyncio.sleep(0.01)


def test_paused_adapter_updates_apply_together_or_are_all_dropped():
    async def run() -> None:
        replicas, sup, weights, _ = _fake_pool()
        await sup.start_all()
        await weights.pause("in_place")
        await _disk(weights, "/b", "v1")
        await _disk(weights, "/c", None)  # joins the label staged before it
        assert [r.adapters["a"] for r in replicas] == [["/a", "default"]] * 2
        done = await weights.resume_generation()
        assert done["lora_weight_versions"] == {"a": "v1"} and "weight_version" not in done
        assert [r.adapters["a"] for r in replicas] == [["/c", "v1"]] * 2
        await weights.pause("in_place")
        await _disk(weights, "/d", "v2")
        replicas[1].refuse.add("update_weights_from_disk")
        with pytest.raises(InvalidRequest, match="every update staged since the pause"):
            await _disk(weights, "/e", "v3")
        await weights.resume_generation()
        # Replica 1 refused the second one but had staged the first: it dropped that too.
        assert [r.adapters["a"] for r in replicas] == [["/c", "v1"]] * 2
        assert weights.adapters.entries["a"].version == "v1"

    asyncio.run(run())


def test_after_a_broadcast_restore_adapter_gives_a_restart_the_trainers_adapter():
    from rollout.pool.weights import Group

    trainer = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8)}

    async def run() -> None:
        replicas, sup, weights, _ = _fake_pool(restore_adapter=lambda name: trainer)
        await sup.start_all()
        await _disk(weights, "/b", "v1")
        weights.groups["g"] = Group((0, 0))
        names = {"names": list(trainer), "dtypes": ["float32"], "shapes": [[4, 8]],
                 "group_name": "g", "lora_name": "a"}  # fmt: skip
        await weights.update("update_weights_from_distributed", (), names, "d1")
        assert [r.adapters["a"] for r in replicas] == [["dist:d1", "d1"]] * 2
        sup.mark_dead(1, "killed")
        await _back(sup, 1)
        assert sup.state == ["serving", "serving"] and replicas[1].starts == 2
        # The last directory, then the trainer's values on top, under the broadcast's label.
        assert replicas[1].adapters["a"] == [f"tensors:{sorted(trainer)}", "d1"]

    asyncio.run(run())


def test_an_undone_unload_gives_the_adapter_its_updated_values_back():
    async def run() -> None:
        replicas, sup, weights, adapters = _fake_pool()
        await sup.start_all()
        await adapters.load("m", "/m0")
        await _disk(weights, "/m1", "v1", name="m")
        replicas[1].refuse.add("unload_lora_adapter")
        with pytest.raises(InvalidRequest, match="unload_lora_adapter refused"):
            await adapters.unload("m")
        # Replica 0 loaded it again from /m0, then got /m1 back under its label.
        assert [r.adapters["m"] for r in replicas] == [["/m1", "v1"]] * 2

    asyncio.run(run())


def test_the_pool_reports_an_adapters_label_once_when_serving_replicas_agree():
    from rollout.pool.server_info import merge_info

    def info(version: str) -> dict:
        return {"lora_weight_versions": {"a": "v1", "b": version}}

    states = [{"state": "serving"}, {"state": "serving"}, {"state": "stale"}]
    routing = [{}] * 3
    merged = merge_info([info("x"), info("y"), info("z")], states, routing, {})
    assert merged["lora_weight_versions"] == {"a": "v1"}
    assert merged["lora_weight_versions_differ"] == {"b": ["x", "y"]}
    merged = merge_info([info("x"), info("x"), info("old")], states, routing, {})
    assert merged["lora_weight_versions"] == {"a": "v1", "b": "x"}  # the stale one is not asked
    assert "lora_weight_versions_differ" not in merged


def test_the_pool_sums_the_replicas_sessions_and_the_kv_they_keep():
    from rollout.pool.server_info import merge_info

    def info(sessions: int, pinned: int, tokens: int) -> dict:
        keys = ("open_sessions", "sessions_with_pinned_kv", "kv_pinned_by_sessions")
        return dict(zip(keys, (sessions, pinned, tokens)))

    states, routing = [{"state": "serving"}] * 2, [{}] * 2
    merged = merge_info([info(2, 1, 40), info(3, 2, 70)], states, routing, {})
    assert (merged["open_sessions"], merged["sessions_with_pinned_kv"]) == (5, 3)
    assert merged["kv_pinned_by_sessions"] == 110


def test_server_info_answers_while_no_replica_does():
    """`rollout router` while every worker is down (restarting): the pool's own state, each
    replica's, and no sizes, instead of a 500."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from rollout.pool.server_info import merge_info
    from rollout.server.app import create_app
    from rollout.server.options import ServerOptions

    states = [{"state": "restarting"}, {"state": "restarting"}]
    pool = SimpleNamespace(
        options=SimpleNamespace(model=SimpleNamespace(model_path="/m")),
        get_server_info=lambda: merge_info([None, None], states, [{}, {}], {"weight_version": "v"}),
    )
    with TestClient(create_app(pool, ServerOptions())) as http:
        for path in ("/get_server_info", "/server_info"):
            answer = http.get(path)
            assert answer.status_code == 200, answer.text
            info = answer.json()
            assert info["weight_version"] == "v" and info["max_total_num_tokens"] is None
            assert [r["state"] for r in info["replicas"]] == ["restarting"] * 2
