"""Weight sync over HTTP through RolloutClient: tensor handoff (shared memory on CPU), disk reload
under allowed roots only, failures that leave the weights and version as they were, pause."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from server_helpers import start_server, stop_server

from rollout.client import RolloutClient

NAME = "model.norm.weight"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    return tmp_path_factory.mktemp("allowed"), tmp_path_factory.mktemp("elsewhere")


@pytest.fixture(scope="module")
def server(tiny_qwen3, roots):
    allowed, _ = roots
    proc, url = start_server(tiny_qwen3, "--api-key", "user", "--admin-api-key", "admin",
                             "--allowed-weight-roots", str(allowed), api_key="user")
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def admin(server):
    with RolloutClient(server, api_key="admin") as c:
        yield c


def _checkpoint(path) -> dict[str, torch.Tensor]:
    return load_file(str(next(path.glob("*.safetensors"))))


def test_weight_endpoints_need_the_admin_key(server):
    with RolloutClient(server, api_key="user") as user:
        with pytest.raises(PermissionError):
            user.update_weight_version("v-user")
        with pytest.raises(PermissionError):
            user.get_weights_by_name(NAME)
        assert user.get_weight_version()  # reading the version is for everyone


def test_tensor_handoff_over_http(admin, tiny_qwen3):
    import pathlib

    original = _checkpoint(pathlib.Path(tiny_qwen3))[NAME]
    before = admin.generate("hello there", GREEDY)["output_ids"]
    new = torch.randn(original.shape, generator=torch.Generator().manual_seed(0)) * 3.0
    result = admin.update_weights_from_tensor([(NAME, new)], weight_version="tensor-v1")
    assert result["success"]
    got = torch.tensor(admin.get_weights_by_name(NAME))
    assert torch.allclose(got, new[: got.shape[0]])
    out = admin.generate("hello there", GREEDY)
    assert out["meta_info"]["weight_version"] == "tensor-v1"
    assert out["output_ids"] != before
    # Restore, so other tests see the checkpoint's outputs again.
    admin.update_weights_from_tensor({NAME: original}, weight_version="tensor-v2")
    assert admin.generate("hello there", GREEDY)["output_ids"] == before


def test_a_tensor_update_with_abort_all_requests_ends_the_requests_in_flight(admin, tiny_qwen3):
    import pathlib
    import threading

    original = _checkpoint(pathlib.Path(tiny_qwen3))[NAME]
    admin.update_weight_version("before-abort")
    started, last = threading.Event(), {}

    def run() -> None:
        params = {"max_new_tokens": 3000, "ignore_eos": True}
        for chunk in admin.generate("count on", params, stream=True):
            started.set()
            last.update(chunk)

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60)
    admin.update_weights_from_tensor({NAME: original}, weight_version="after-abort", abort_all_requests=True)
    thread.join(60)
    meta = last["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 3000
    assert meta["weight_version"] == "before-abort"
    assert admin.get_weight_version() == "after-abort"


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [("/update_weights_from_disk", {"model_path": "/x", "abort_all_requests": "yes"}, "abort_all_requests"),
     ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 5}, "weight_version"),
     ("/update_weights_from_tensor", {"tensor_handles": {}, "flush_cache": "no"}, "flush_cache"),
     ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": "29500",
                                     "rank_offset": 1, "world_size": 2}, "master_port"),
     ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 29500,
                                     "rank_offset": 1, "world_size": 2, "timeout_s": "1"}, "timeout_s"),
     ("/update_weights_from_distributed", {"names": [NAME], "dtypes": ["float32"], "shapes": [["4"]],
                                           "group_name": "g"}, "shapes"),
     ("/release_memory_occupation", {"tags": ["kv_cache", 1]}, "tags")],
)  # fmt: skip
def test_a_weight_body_of_the_wrong_types_is_refused_not_converted(admin, path, body, field):
    version = admin.get_weight_version()
    answer = httpx.post(f"{admin.base_url}{path}", json=body, headers=admin.headers, timeout=60)
    assert answer.status_code == 400 and field in answer.text, answer.text[:300]
    assert admin.get_weight_version() == version


def test_failed_updates_change_nothing(admin):
    version = admin.get_weight_version()
    weights = admin.get_weights_by_name(NAME)
    reference = admin.generate("stable", GREEDY)["output_ids"]
    with pytest.raises(ValueError, match="no_such"):
        admin.update_weights_from_tensor(
            [(NAME, torch.zeros(len(weights))), ("model.no_such.weight", torch.zeros(3))], weight_version="bad"
        )
    with pytest.raises(ValueError, match="shape"):
        admin.update_weights_from_tensor([(NAME, torch.zeros(len(weights) + 1))], weight_version="bad")
    bogus = {"tensor_handles": {"format": "pickle", "data": "gASV"}}
    resp = httpx.post(f"{admin.base_url}/update_weights_from_tensor", json=bogus, headers=admin.headers)
    assert resp.status_code == 400
    assert admin.get_weight_version() == version
    assert admin.get_weights_by_name(NAME) == weights
    assert admin.generate("stable", GREEDY)["output_ids"] == reference


def test_disk_reload_only_under_allowed_roots(admin, tiny_qwen3, roots):
    import pathlib

    allowed, elsewhere = roots
    tensors = _checkpoint(pathlib.Path(tiny_qwen3))
    for root in (allowed, elsewhere):
        ckpt = root / "step-1"
        shutil.copytree(tiny_qwen3, ckpt)
        for f in ckpt.glob("*.safetensors"):
            f.unlink()
        save_file({**tensors, NAME: tensors[NAME] * 2.0}, str(ckpt / "model.safetensors"))
    with pytest.raises(PermissionError, match="allowed root"):
        admin.update_weights_from_disk(str(elsewhere / "step-1"), weight_version="disk")
    with pytest.raises(PermissionError, match="allowed root"):
        admin.update_weights_from_disk(str(allowed / ".." / elsewhere.name / "step-1"))
    assert admin.update_weights_from_disk(str(allowed / "step-1"), weight_version="disk-v1")["success"]
    assert admin.get_weight_version() == "disk-v1"
    got = torch.tensor(admin.get_weights_by_name(NAME))
    assert torch.allclose(got, (tensors[NAME] * 2.0)[: got.shape[0]])
    admin.update_weights_from_tensor({NAME: tensors[NAME]}, weight_version="restored")


def test_version_publish_and_pause_continue(admin):
    assert admin.update_weight_version("published")["success"]
    # Every output names the version: one that no JSON answer can hold is refused.
    lone_surrogate = httpx.post(f"{admin.base_url}/update_weight_version", content=b'{"new_version": "v\\ud800"}',
                                headers={"Authorization": "Bearer admin", "content-type": "application/json"})  # fmt: skip
    assert lone_surrogate.status_code == 400 and "is not valid Unicode" in lone_surrogate.text
    # ... and so is one that would break the lines of a log or a terminal.
    newline = httpx.post(f"{admin.base_url}/update_weight_version", json={"new_version": "v\nw"},
                         headers={"Authorization": "Bearer admin"})  # fmt: skip
    assert newline.status_code == 400 and "control characters" in newline.text
    assert admin.generate("v", GREEDY)["meta_info"]["weight_version"] == "published"
    assert admin.pause_generation(mode="retract")["success"]
    with pytest.raises(ValueError, match="mode"):
        admin.pause_generation(mode="sideways")
    assert admin.continue_generation()["success"]
    assert admin.generate("after", GREEDY)["meta_info"]["completion_tokens"] == 8
