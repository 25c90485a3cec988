"""`rollout serve --dp-size 2`: two engine replicas of the tiny model on a local Ray cluster behind
one server: greedy outputs equal transformers, the server reports two data-parallel ranks, a GRPO
group lands on one replica, admin calls reach both, and SIGTERM stops it all with status 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray")

from pool_helpers import GREEDY, PROMPTS, free_port, hf_greedy, wait_for  # noqa: E402
from server_helpers import SERVER_ARGS, stop_server  # noqa: E402

from rollout.client import RolloutClient  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_qwen3, tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.serve", "--model-path", tiny_qwen3, "--port", str(port),
           "--dp-size", "2", "--admin-api-key", "admin", "--allowed-weight-roots", tiny_qwen3,
           *SERVER_ARGS]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    client = RolloutClient(f"http://127.0.0.1:{port}", api_key="admin")
    try:
        wait_for(lambda: proc.poll() is not None or client.health(), 180, "dp server not up")
        assert proc.poll() is None, log.read_text()
        client.wait_ready(timeout=60)
        yield {"client": client, "proc": proc, "log": log}
    finally:
        client.close()
        stop_server(proc, timeout=60)


def test_greedy_through_two_replicas_equals_transformers(server, tiny_qwen3):
    out = server["client"].generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o["output_ids"] for o in out] == hf_greedy(tiny_qwen3, PROMPTS)


def test_the_server_reports_two_data_parallel_ranks(server):
    client = server["client"]
    info = client.get_server_info()
    assert info["dp_size"] == 2 and len(info["replicas"]) == 2
    load = client._http.get("/get_load").json()
    assert [entry["dp_rank"] for entry in load] == [0, 1]


def test_a_grpo_group_lands_on_one_replica(server):
    client = server["client"]
    before = [r["routing"]["routed"] for r in client.get_server_info()["replicas"]]
    prompt = [7, 8, 9, 10, 11, 12, 13, 14] * 4
    client.generate(input_ids=[prompt] * 4, sampling_params={"max_new_tokens": 4, "seed": 1})
    after = [r["routing"]["routed"] for r in client.get_server_info()["replicas"]]
    grew = [b - a for a, b in zip(before, after)]
    assert sorted(grew) == [0, 4], grew


def test_admin_calls_reach_both_replicas(server):
    client = server["client"]
    assert client.flush_cache()["success"]
    before = client.get_server_info()
    client.update_weights_from_disk(before["model_path"], weight_version="same")
    info = client.get_server_info()
    assert {r["info"]["weight_version"] for r in info["replicas"]} == {"same"}
    assert info["weight_updates"] == before["weight_updates"] + 1  # the pool's, not a sum


def test_sigterm_stops_the_server_and_its_replicas_with_status_0(server):
    stop_server(server["proc"], timeout=60)
    assert server["proc"].returncode == 0, server["log"].read_text()[-3000:]
