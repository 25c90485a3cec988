"""RolloutPool on a local Ray cluster: two replicas of the tiny model (CPU, fp32) against
transformers; prefix routing of a GRPO group; one gloo broadcast for both replicas; all-or-
nothing updates; a replica killed mid-generation. One pool for the module."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")

import pool_helpers  # noqa: E402
from pool_helpers import GREEDY, PROMPTS, broadcast_update, hf_greedy, wait_for, weights  # noqa: E402
from ray import cloudpickle  # noqa: E402 - Ray's own, which pickles its setup hook

from rollout.pool import PoolOptions, RolloutPool  # noqa: E402

ENGINE = {"device": "cpu", "dtype": "float32", "max_total_tokens": 4096}


@pytest.fixture(scope="module")
def expected(tiny_qwen3, tiny_qwen3_perturbed) -> dict[str, list[list[int]]]:
    return {
        "base": hf_greedy(tiny_qwen3, PROMPTS),
        "perturbed": hf_greedy(tiny_qwen3_perturbed, PROMPTS),
    }


@pytest.fixture(scope="module")
def pool(tiny_qwen3):
    # The tests' stand-in for discard_staged_weights travels by value to every Ray worker.
    cloudpickle.register_pickle_by_value(pool_helpers)
    env = {"worker_process_setup_hook": pool_helpers.install_discard_fallback}
    ray_init = {"num_cpus": 2, "runtime_env": env, "log_to_driver": False}
    options = PoolOptions(health_check_s=1.0, wait_for_replica_s=120)
    with RolloutPool(
        tiny_qwen3, replicas=2, ray_init=ray_init, pool_options=options, **ENGINE
    ) as p:
        yield p


def _on_each_replica(pool) -> list[list[list[int]]]:
    """Every replica's own greedy answer to PROMPTS, bypassing the router."""
    return [
        [
            o["output_ids"]
            for o in pool.replica_call(i, "generate", input_ids=PROMPTS, sampling_params=GREEDY)
        ]
        for i in range(2)
    ]


def _versions(pool) -> list[str]:
    return [pool.replica_call(i, "get_weight_version") for i in range(2)]


def test_greedy_outputs_through_the_pool_equal_transformers(pool, expected):
    outs = pool.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == expected["base"]
    single = pool.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
    assert single["output_ids"] == expected["base"][0]
    streamed = list(pool.generate(input_ids=PROMPTS[1], sampling_params=GREEDY, stream=True))
    assert streamed[-1]["output_ids"] == expected["base"][1] and len(streamed) > 1
    routed = [r["routed"] for r in pool.stats()["replicas"]]
    assert all(n > 0 for n in routed)  # the batch was spread over both replicas
    info = pool.get_server_info()
    assert info["num_replicas"] == 2 and info["num_serving"] == 2
    assert info["kv_total"] == 2 * 4096 and info["weight_group_ranks"] == 2


def test_a_grpo_group_lands_on_one_replica_with_prefix_hits(pool):
    before = pool.stats()["replicas"]
    group = [PROMPTS[0]] * 8  # the group sent as 8 requests of one prompt (one batch)
    params = {"temperature": 1.0, "max_new_tokens": 4, "seed": 7}
    outs = pool.generate(input_ids=group, sampling_params=params)
    after = pool.stats()["replicas"]
    routed = [a["routed"] - b["routed"] for a, b in zip(after, before)]
    hits = [a["prefix_hits"] - b["prefix_hits"] for a, b in zip(after, before)]
    assert sorted(routed) == [0, 8] and sorted(hits) == [0, 8]  # the prompt was seen before
    assert len({tuple(o["output_ids"]) for o in outs}) == 1  # same seed, same replica
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs[1:])
    one = pool.generate(input_ids=PROMPTS[0], sampling_params={**params, "n": 8})
    assert (
        len(one) == 8
        and pool.stats()["replicas"][routed.index(8)]["routed"]
        == after[routed.index(8)]["routed"] + 1
    )


def test_one_gloo_broadcast_updates_both_replicas(pool, expected, tiny_qwen3_perturbed):
    result = broadcast_update(pool, weights(tiny_qwen3_perturbed), world_size=3, version="dist-1")
    assert result["weight_version"] == "dist-1" and result["replicas"] == 2
    assert _versions(pool) == ["dist-1", "dist-1"] and pool.get_weight_version() == "dist-1"
    assert _on_each_replica(pool) == [expected["perturbed"]] * 2
    outs = pool.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert {o["meta_info"]["weight_version"] for o in outs} == {"dist-1"}
    with pytest.raises(ValueError, match="world_size must be rank_offset"):
        pool.init_weights_update_group("127.0.0.1", pool_helpers.free_port(), 1, 2, "g", "gloo", 5)


def test_a_failed_update_on_one_replica_leaves_both_on_the_old_version(pool, expected, tiny_qwen3):
    before = _versions(pool)
    pool.replica_call(1, "release_memory_occupation", ["weights"])  # replica 1 will refuse
    try:
        with pytest.raises(
            ValueError, match="replica 1.*weights are released.*dropped on every replica"
        ):
            pool.update_weights_from_disk(tiny_qwen3, weight_version="never")
    finally:
        pool.replica_call(1, "resume_memory_occupation", ["weights"])
    assert _versions(pool) == before and pool.get_weight_version() == before[0]
    assert _on_each_replica(pool) == [expected["perturbed"]] * 2  # replica 0 dropped its stage
    info = pool.get_server_info()
    assert info["generation_paused"] is None and info["weight_update_staged"] == 0


def test_a_tensor_update_reaches_both_replicas(pool, expected, tiny_qwen3):
    result = pool.update_weights_from_tensor(weights(tiny_qwen3), weight_version="tensor-1")
    assert result["weight_version"] == "tensor-1"
    assert _versions(pool) == ["tensor-1", "tensor-1"]
    assert _on_each_replica(pool) == [expected["base"]] * 2


def test_killing_a_replica_mid_generation_loses_no_request(pool, expected):
    long = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    reference = [
        o["output_ids"]
        for o in pool.replica_call(0, "generate", input_ids=PROMPTS, sampling_params=long)
    ]
    results: dict = {}
    worker = threading.Thread(
        target=lambda: results.update(
            outs=pool.generate(input_ids=PROMPTS * 2, sampling_params=long)
        )
    )
    pid = ray.get(pool.replicas[1].actor.pid.remote())
    worker.start()
    # The kill follows the router's dispatch to replica 1 within a millisecond or so: its
    # requests (200 tokens each, about 0.1 s on a fast CPU) are still running there. Polling
    # the replica itself (a Ray call, wait_for's 0.2 s steps) could miss them altogether.
    deadline = time.monotonic() + 60
    while pool.stats()["replicas"][1]["in_flight"] == 0:
        assert time.monotonic() < deadline, "nothing was routed to replica 1"
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)  # the actor's process crashes; its engine goes with it
    worker.join(timeout=180)
    outs = results["outs"]
    assert [o["output_ids"] for o in outs] == reference * 2  # every request answered, in order
    assert any(o["meta_info"].get("retried") for o in outs)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    # The replica comes back with the pool's weights (the tensor snapshot) before taking traffic.
    wait_for(lambda: pool.stats()["replicas"][1]["state"] == "serving", 120, "replica 1 not back")
    stats = pool.stats()["replicas"][1]
    assert stats["restarts"] == 1 and stats["deaths"] == 1
    assert _versions(pool) == ["tensor-1", "tensor-1"]
    assert _on_each_replica(pool) == [expected["base"]] * 2
    again = pool.generate(input_ids=[[9] * 30, [11] * 30, [13] * 30], sampling_params=GREEDY)
    assert len(again) == 3 and pool.stats()["replicas"][1]["routed"] > stats["routed"]


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        ({"num_gpus_per_replica": -1}, "num_gpus_per_replica must be a number >= 0, got -1"),
        ({"num_cpus_per_replica": "2"}, "num_cpus_per_replica must be a number >= 0"),
        ({"num_gpus_per_replica": 1.5}, "above 1 must be a whole number of GPUs, got 1.5"),
        ({"num_cpus_per_replica": 0, "num_gpus_per_replica": 0}, "needs some CPUs or GPUs"),
        ({"placement_strategy": "spread"}, "placement_strategy must be one of PACK, SPREAD"),
    ],
)
def test_a_placement_ray_cannot_make_is_refused_before_ray_starts(tiny_qwen3, monkeypatch, placement, message):
    # A negative GPU count used to wait out the 300 s placement timeout.
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started"))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match=message):
        RolloutPool(tiny_qwen3, replicas=2, **ENGINE, **placement)


def test_a_replica_that_missed_its_ping_is_killed_without_the_graceful_wait(monkeypatch):
    """A replica that answered no health check is killed at once when it is restarted (its
    requests wait for that); one that answers is asked to shut down first."""
    import asyncio

    from rollout.pool import ray_replica

    monkeypatch.setattr(ray_replica, "PING_TIMEOUT_S", 0.05)
    monkeypatch.setattr(ray_replica, "STOP_TIMEOUT_S", 0.05)
    calls: list[str] = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart: calls.append(f"kill {actor.name}"))

    class Actor:
        def __init__(self, name: str, answers: bool) -> None:
            self.name, self.answers = name, answers
            self.alive = self.shutdown = self

        def remote(self) -> asyncio.Future:  # alive() and shutdown(): one stub for both
            calls.append(f"call {self.name}")
            future = asyncio.get_running_loop().create_future()
            if self.answers:
                future.set_result((True, None))
            return future  # a frozen actor's never completes

    async def run() -> None:
        replica = ray_replica.RayReplica(0, "m", {}, None, 1, 0)
        replica.actor = Actor("frozen", answers=False)
        assert not await replica.alive()
        await replica.stop()
        assert calls == ["call frozen", "kill frozen"]  # the ping only, no shutdown
        calls.clear()
        replica.actor = Actor("fine", answers=True)
        assert await replica.alive()
        await replica.stop()
        assert calls == ["call fine", "call fine", "kill fine"]  # the ping, then shutdown

    asyncio.run(run())
