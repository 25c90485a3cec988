"""`rollout router` over two `rollout serve` workers on localhost, through RolloutClient: the
pool's checks over HTTP (greedy outputs against transformers, a GRPO group on one worker, one
gloo broadcast for both workers, an update one worker refuses, a worker killed mid-generation
and restarted by its supervisor, here the test)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from pool_helpers import GREEDY, PROMPTS, broadcast_update, free_port, hf_greedy, wait_for
from server_helpers import SERVER_ARGS, start_process, stop_server

from rollout.client import RolloutClient

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER_KEY, USER_KEY, ADMIN_KEY = "worker-admin", "user", "admin"


def _worker(model: str, port: int, roots: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, os.path.join(HERE, "pool_worker.py"), "--model-path", model,
           "--port", str(port), "--admin-api-key", WORKER_KEY, *SERVER_ARGS]  # fmt: skip
    for root in roots:
        cmd += ["--allowed-weight-roots", root]
    return start_process(cmd, f"http://127.0.0.1:{port}", WORKER_KEY)


@pytest.fixture(scope="module")
def layout(tiny_qwen3, tiny_qwen3_perturbed, tmp_path_factory) -> dict:
    """Checkpoints under two roots: worker 0 may read both, worker 1 only `shared`."""
    base = tmp_path_factory.mktemp("pool-roots")
    own, shared = base / "own", base / "shared"
    shutil.copytree(tiny_qwen3, own / "base")
    shutil.copytree(tiny_qwen3_perturbed, shared / "perturbed")
    return {
        "own": str(own),
        "shared": str(shared),
        "base": str(own / "base"),
        "perturbed": str(shared / "perturbed"),
    }


@pytest.fixture(scope="module")
def cluster(tiny_qwen3, layout):
    ports = [free_port(), free_port()]
    roots = [[layout["own"], layout["shared"]], [layout["shared"]]]
    workers = {}
    try:
        for i in range(2):
            workers[i] = _worker(tiny_qwen3, ports[i], roots[i])
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        port = free_port()
        cmd = [sys.executable, "-m", "rollout.pool.http_router", "--worker-urls", *urls,
               "--worker-api-key", WORKER_KEY, "--port", str(port), "--api-key", USER_KEY,
               "--admin-api-key", ADMIN_KEY, "--allowed-weight-roots", layout["own"],
               "--allowed-weight-roots", layout["shared"], "--health-check-s", "0.5"]  # fmt: skip
        workers["router"] = start_process(cmd, f"http://127.0.0.1:{port}", ADMIN_KEY)
        yield {"router": f"http://127.0.0.1:{port}", "urls": urls, "procs": workers, "roots": roots,
               "model": tiny_qwen3}  # fmt: skip
    finally:
        for proc in workers.values():
            stop_server(proc)


@pytest.fixture(scope="module")
def expected(tiny_qwen3, tiny_qwen3_perturbed) -> dict[str, list[list[int]]]:
    return {
        "base": hf_greedy(tiny_qwen3, PROMPTS),
        "perturbed": hf_greedy(tiny_qwen3_perturbed, PROMPTS),
    }


@pytest.fixture(scope="module")
def admin(cluster):
    with RolloutClient(cluster["router"], api_key=ADMIN_KEY) as client:
        yield client


def _each_worker(cluster, what):
    out = []
    for url in cluster["urls"]:
        with RolloutClient(url, api_key=WORKER_KEY) as worker:
            out.append(what(worker))
    return out


def _greedy(client) -> list[list[int]]:
    return [o["output_ids"] for o in client.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _routing(admin) -> list[dict]:
    return [r["routing"] for r in admin.get_server_info()["replicas"]]


def test_greedy_over_http_equals_transformers_and_keys_are_checked(cluster, admin, expected):
    with RolloutClient(cluster["router"], api_key=USER_KEY) as user:
        assert _greedy(user) == expected["base"]
        streamed = list(user.generate(input_ids=PROMPTS[2], sampling_params=GREEDY, stream=True))
        assert streamed[-1]["output_ids"] == expected["base"][2]
        with pytest.raises(PermissionError):
            user.flush_cache()  # admin only, as on rollout serve
    assert (
        httpx.post(cluster["router"] + "/generate", json={"input_ids": [1, 2]}).status_code == 401
    )
    body = {"model": cluster["model"], "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    answer = httpx.post(cluster["router"] + "/v1/completions", json=body,
                        headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=60)  # fmt: skip
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    assert all(r["routed"] > 0 for r in _routing(admin))  # both workers served


def test_a_one_prompt_answer_is_the_workers_json_as_it_wrote_it(cluster, admin, expected):
    """One prompt is relayed (rollout/pool/generate_relay.py): the router's answer is the bytes
    its worker wrote (the request's id and latency aside, which differ between any two calls)."""
    body = {"input_ids": PROMPTS[1], "sampling_params": GREEDY, "return_logprob": True}

    def answer(url: str, key: str) -> bytes:
        resp = httpx.post(url + "/generate", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key}"})  # fmt: skip
        assert resp.status_code == 200
        return re.sub(rb'"(id|e2e_latency)":("[^"]*"|[-+.e0-9]+)', rb'"\1":0', resp.content)

    before = _routing(admin)
    answer(cluster["router"], USER_KEY)  # the worker it lands on caches the prompt
    first = _routing(admin)
    worker = next(i for i, (a, b) in enumerate(zip(first, before)) if a != b)
    answer(cluster["urls"][worker], WORKER_KEY)
    routed = answer(cluster["router"], USER_KEY)
    direct = answer(cluster["urls"][worker], WORKER_KEY)
    assert routed == direct and json.loads(routed)["output_ids"] == expected["base"][1]
    second = _routing(admin)  # the same worker again, for the prefix it holds
    assert second[worker]["routed"] == first[worker]["routed"] + 1
    assert second[worker]["prefix_hits"] == first[worker]["prefix_hits"] + 1


def test_a_grpo_group_lands_on_one_worker(admin):
    before = _routing(admin)
    admin.generate(input_ids=[PROMPTS[0]] * 6, sampling_params={"max_new_tokens": 4, "seed": 1})
    after = _routing(admin)
    routed = sorted(a["routed"] - b["routed"] for a, b in zip(after, before))
    hits = sorted(a["prefix_hits"] - b["prefix_hits"] for a, b in zip(after, before))
    assert routed == [0, 6] and hits == [0, 6]


def test_one_gloo_broadcast_through_the_router_updates_both_workers(
    cluster, admin, expected, tiny_qwen3_perturbed
):
    from pool_helpers import weights

    result = broadcast_update(admin, weights(tiny_qwen3_perturbed), world_size=3, version="dist-1")
    assert result["weight_version"] == "dist-1"
    assert _each_worker(cluster, lambda w: w.get_weight_version()) == ["dist-1", "dist-1"]
    assert _each_worker(cluster, _greedy) == [expected["perturbed"]] * 2


def test_an_update_one_worker_refuses_leaves_both_on_the_old_version(
    cluster, admin, layout, expected
):
    with pytest.raises(PermissionError, match="replica 1.*not under an allowed root"):
        admin.update_weights_from_disk(layout["base"], weight_version="never")
    assert _each_worker(cluster, lambda w: w.get_weight_version()) == ["dist-1", "dist-1"]
    assert _each_worker(cluster, _greedy) == [expected["perturbed"]] * 2  # worker 0 dropped it
    assert admin.get_weight_version() == "dist-1"
    result = admin.update_weights_from_disk(layout["perturbed"], weight_version="disk-1")
    assert result["weight_version"] == "disk-1"
    assert _each_worker(cluster, lambda w: w.get_weight_version()) == ["disk-1", "disk-1"]


def test_a_tensor_update_through_the_router_reaches_both_workers(
    cluster, admin, expected, tiny_qwen3
):
    from pool_helpers import weights

    # Shared-memory handles from this process, loaded by both workers (one host).
    assert admin.update_weights_from_tensor(weights(tiny_qwen3), weight_version="tensor-1")[
        "success"
    ]
    assert _each_worker(cluster, lambda w: w.get_weight_version()) == ["tensor-1", "tensor-1"]
    assert _each_worker(cluster, _greedy) == [expected["base"]] * 2


def test_a_worker_killed_mid_generation_loses_no_request(cluster, admin, layout, expected):
    long = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}
    with RolloutClient(cluster["urls"][0], api_key=WORKER_KEY) as w0:
        reference = [o["output_ids"] for o in w0.generate(input_ids=PROMPTS, sampling_params=long)]
    results: dict = {}
    run = threading.Thread(
        target=lambda: results.update(
            outs=admin.generate(input_ids=PROMPTS * 2, sampling_params=long)
        )
    )
    run.start()
    with RolloutClient(cluster["urls"][1], api_key=WORKER_KEY) as w1:
        # Its requests run for a fraction of a second on a fast CPU: polled every few ms.
        running = lambda: w1.get_server_info()["num_running"] > 0  # noqa: E731
        wait_for(running, 60, "worker 1 never ran", interval=0.002)
    os.kill(cluster["procs"][1].pid, signal.SIGKILL)
    run.join(timeout=180)
    outs = results["outs"]
    assert [o["output_ids"] for o in outs] == reference * 2
    assert any(o["meta_info"].get("retried") for o in outs)
    states = [r["state"] for r in admin.get_server_info()["replicas"]]
    assert states[0] == "serving" and states[1] != "serving"
    # Its supervisor (the test) starts it again, from its own checkpoint (the perturbed one
    # here: not what the pool serves); the router takes it back only once it has reloaded the
    # pool's last checkpoint and the router's copy of the tensor update since.
    port = int(cluster["urls"][1].rsplit(":", 1)[1])
    cluster["procs"][1] = _worker(layout["perturbed"], port, cluster["roots"][1])
    wait_for(
        lambda: admin.get_server_info()["replicas"][1]["state"] == "serving",
        60,
        "worker 1 not back",
    )
    assert _each_worker(cluster, lambda w: w.get_weight_version()) == ["tensor-1", "tensor-1"]
    assert _each_worker(cluster, _greedy) == [expected["base"]] * 2
