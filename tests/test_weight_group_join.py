"""Joining a weight update group never stalls generation: the join waits on a thread and its
reply comes when it ends; calls for that group wait for it; a failed join leaves nothing behind.
Plus: CUDA tensor handles sent to a CPU engine are the sender's mistake (400), not a 502."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import load_file
from server_helpers import free_port, start_server, stop_server

from rollout.client import RolloutClient
from rollout.weight_sync import distributed_source
from rollout.weight_sync.update_group import UpdateGroup, WeightSyncError

JOIN_TIMEOUT_S = 3.0
STREAMED = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def admin(tiny_qwen3):
    proc, url = start_server(tiny_qwen3)
    with RolloutClient(url) as client:
        yield client
    stop_server(proc)


@pytest.fixture(scope="module")
def pool():
    with ThreadPoolExecutor(4) as p:
        yield p


def _groups(admin) -> tuple[list[str], list[str]]:
    info = admin.get_server_info()
    return info["weight_update_groups"], info["weight_update_groups_joining"]


def _wait_joining(admin, name: str) -> None:
    deadline = time.monotonic() + 10
    while name not in _groups(admin)[1]:
        assert time.monotonic() < deadline, f"the join of {name!r} never started"
        time.sleep(0.01)


def test_a_join_to_a_dead_address_does_not_stall_generation(admin, pool):
    reference = admin.generate("join", STREAMED)["output_ids"]
    for _attempt in range(2):  # the second behaves as the first: nothing was left behind
        stream = admin.generate("join", STREAMED, stream=True)
        first = next(stream)  # a request is running
        join = pool.submit(
            admin.init_weights_update_group, "127.0.0.1", free_port(), 1, 2, "dead", "gloo",
            JOIN_TIMEOUT_S,
        )  # fmt: skip
        _wait_joining(admin, "dead")
        with pytest.raises(ValueError, match="'dead' is being joined"):
            admin.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "dead", "gloo", 3.0)
        destroy = pool.submit(admin.destroy_weights_update_group, "dead")  # waits for the join
        *_, last = [first, *stream]
        assert last["output_ids"] == reference
        assert admin.generate("join", GREEDY)["output_ids"] == reference[:8]  # sent after
        assert not join.done() and not destroy.done()  # all of it while the join is pending
        with pytest.raises(WeightSyncError, match="could not join weight update group 'dead'"):
            join.result(timeout=60)
        with pytest.raises(ValueError, match="no weight update group 'dead'"):
            destroy.result(timeout=10)
        assert _groups(admin) == ([], [])


def test_an_update_sent_while_joining_waits_for_the_join(admin, pool, tiny_qwen3):
    """A trainer may send the update right after asking the engine to join: it runs once the
    group is there, in order, instead of failing with 'no group'."""
    weights = load_file(f"{tiny_qwen3}/model.safetensors")
    named = list(weights.items())
    port = free_port()
    join = pool.submit(admin.init_weights_update_group, "127.0.0.1", port, 1, 2, "late", "gloo", 30)
    _wait_joining(admin, "late")
    update = pool.submit(
        admin.update_weights_from_distributed, [n for n, _ in named], ["float32"] * len(named),
        [list(t.shape) for _, t in named], "late", weight_version="after-join",
    )  # fmt: skip
    # Nobody listens at `port` until the trainer joins below: generation goes on meanwhile.
    assert admin.generate("while joining", GREEDY)["meta_info"]["completion_tokens"] == 8
    assert not join.done() and not update.done()  # the update neither refused nor run: waiting
    group = UpdateGroup.join("127.0.0.1", port, 0, 2, "late", "gloo", 30)  # the trainer, rank 0
    try:
        assert join.result(timeout=30)["success"]
        distributed_source.send(group, named, None)
        assert update.result(timeout=30)["weight_version"] == "after-join"
    finally:
        group.close()
    assert admin.destroy_weights_update_group("late")["success"]
    assert _groups(admin) == ([], [])


def test_cuda_handles_on_a_cpu_engine_are_a_client_error(admin):
    if torch.cuda.is_available():
        pytest.skip("this engine's process could open CUDA handles")
    version = admin.get_weight_version()
    buffer = {
        "device": 0, "nbytes": 64, "offset": 0, "ref_counter_offset": 0, "handle": "AAAA",
        "ref_counter_handle": "AAAA", "event_handle": "AAAA", "event_sync_required": False,
    }  # fmt: skip
    tensor = {
        "name": "model.norm.weight",
        "dtype": "float32",
        "shape": [16],
        "buffer": 0,
        "offset": 0,
    }
    handles = {
        "format": "rollout.tensor_handles/1", "kind": "cuda", "buffers": [buffer], "tensors": [tensor]
    }  # fmt: skip
    resp = httpx.post(
        f"{admin.base_url}/update_weights_from_tensor", json={"tensor_handles": handles}
    )
    assert resp.status_code == 400, resp.text
    assert "CUDA tensor handles need a GPU engine" in resp.json()["error"]["message"]
    assert admin.get_weight_version() == version
