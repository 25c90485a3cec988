"""--allowed-weight-roots cannot be escaped: every file a disk update opens (config.json, the
index, each shard) must resolve under a root, symlinks followed, and an index may only name
files inside the checkpoint. A refused update leaves the old weights serving. Symlinks that
stay inside a root (the Hugging Face cache layout) keep working."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from server_helpers import start_server, stop_server

from rollout.client import RolloutClient
from rollout.models import loader
from rollout.models.loader import (
    OutsideRootsError,
    iter_safetensors,
    open_checked,
    safetensors_files,
)
from rollout.weight_sync import disk_source

NAME = "model.norm.weight"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
INDEX = "model.safetensors.index.json"


def _write(path: Path, config_from: str, tensors: dict[str, torch.Tensor]) -> Path:
    """A checkpoint of two shards and an index (config.json copied from `config_from`)."""
    path.mkdir(parents=True)
    shutil.copy(os.path.join(config_from, "config.json"), path / "config.json")
    names = sorted(tensors)
    halves = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    for shard, part in halves.items():
        save_file({n: tensors[n].contiguous() for n in part}, str(path / shard))
    _index(path, {n: shard for shard, part in halves.items() for n in part})
    return path


def _index(path: Path, weight_map: dict[str, str]) -> None:
    (path / INDEX).unlink(missing_ok=True)
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _renamed(path: Path, shard: str, entry: str) -> None:
    """Points every weight of `shard` at the index entry `entry` instead."""
    weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    _index(path, {n: entry if s == shard else s for n, s in weight_map.items()})


@pytest.fixture(scope="module")
def tensors(tiny_qwen3) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(tiny_qwen3, "model.safetensors"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_qwen3, tensors):
    """The allowed root, a directory outside it holding a complete (different) checkpoint."""
    root, outside = tmp_path_factory.mktemp("root"), tmp_path_factory.mktemp("outside")
    _write(outside / "ckpt", tiny_qwen3, {**tensors, NAME: tensors[NAME] * 3.0})
    return root, outside


@pytest.fixture(scope="module")
def server(tiny_qwen3, dirs):
    root, _ = dirs
    args = ["--admin-api-key", "admin", "--allowed-weight-roots", str(root)]
    proc, url = start_server(tiny_qwen3, *args)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def admin(server):
    with RolloutClient(server, api_key="admin") as c:
        yield c


def _refused(admin, path: Path, error: type[Exception], match: str) -> str:
    """Sends the update, expects it refused; the weights, version and outputs are unchanged."""
    version, weights = admin.get_weight_version(), admin.get_weights_by_name(NAME)
    reference = admin.generate("roots", GREEDY)["output_ids"]
    with pytest.raises(error, match=match) as err:
        admin.update_weights_from_disk(str(path), weight_version="escaped")
    assert admin.get_weight_version() == version
    assert admin.get_weights_by_name(NAME) == weights
    assert admin.generate("roots", GREEDY)["output_ids"] == reference
    return str(err.value)


@pytest.mark.parametrize("entry", ["absolute", "../", "/etc/passwd", "sub/../../b.safetensors"])
def test_index_naming_files_outside_the_checkpoint_is_refused(
    admin, dirs, tiny_qwen3, tensors, entry
):
    root, outside = dirs
    doubled = {**tensors, NAME: tensors[NAME] * 2}
    ckpt = _write(root / f"bad-entry-{len(os.listdir(root))}", tiny_qwen3, doubled)
    bad = {
        "absolute": str(outside / "ckpt" / "b.safetensors"),
        "../": f"../../{outside.name}/ckpt/b.safetensors",
    }.get(entry, entry)
    _renamed(ckpt, "b.safetensors", bad)
    message = _refused(admin, ckpt, ValueError, "outside the checkpoint")
    assert repr(bad) in message and "relative file names" in message
    assert "root:" not in message  # nothing of /etc/passwd's content


@pytest.mark.parametrize("target", ["shard", "passwd", "config", "index"])
def test_symlinks_out_of_the_roots_are_refused_without_saying_where(
    admin, dirs, tiny_qwen3, tensors, target
):
    root, outside = dirs
    ckpt = _write(root / f"link-{target}", tiny_qwen3, {**tensors, NAME: tensors[NAME] * 2})
    name, points_to = {
        "shard": ("b.safetensors", outside / "ckpt" / "b.safetensors"),
        "passwd": ("b.safetensors", Path("/etc/passwd")),
        "config": ("config.json", outside / "ckpt" / "config.json"),
        "index": (INDEX, outside / "ckpt" / INDEX),
    }[target]
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(points_to)
    message = _refused(admin, ckpt, PermissionError, "outside the allowed weight roots")
    assert name in message
    assert str(outside) not in message and "passwd" not in message


def test_symlinks_inside_a_root_work_as_in_the_hugging_face_cache(admin, dirs, tiny_qwen3, tensors):
    root, _ = dirs
    repo = root / "hub" / "models--tiny"
    ckpt = _write(repo / "snapshots" / "rev1", tiny_qwen3, {**tensors, NAME: tensors[NAME] * 2})
    (repo / "blobs").mkdir()
    for i, name in enumerate(["config.json", INDEX, "a.safetensors", "b.safetensors"]):
        (ckpt / name).rename(repo / "blobs" / f"hash{i}")
        (ckpt / name).symlink_to(Path("..") / ".." / "blobs" / f"hash{i}")
    assert admin.update_weights_from_disk(str(ckpt), weight_version="from-cache")["success"]
    assert admin.get_weight_version() == "from-cache"
    got = torch.tensor(admin.get_weights_by_name(NAME))
    assert torch.allclose(got, (tensors[NAME] * 2)[: got.shape[0]])
    admin.update_weights_from_tensor({NAME: tensors[NAME]}, weight_version="restored")


# ---- the loader itself (what the Python API and startup use) ---------------------------------
@pytest.fixture
def sharded(tmp_path, tiny_qwen3, tensors) -> Path:
    return _write(tmp_path / "ckpt", tiny_qwen3, tensors)


@pytest.mark.parametrize(
    "entry", ["/abs/b.safetensors", "../b.safetensors", "x/../../b.safetensors", "", 7]
)
def test_loader_refuses_shard_names_outside_the_checkpoint_even_without_roots(sharded, entry):
    _renamed(sharded, "b.safetensors", entry)
    with pytest.raises(ValueError, match=INDEX):
        safetensors_files(str(sharded))
    with pytest.raises(ValueError, match=INDEX):
        list(iter_safetensors(str(sharded)))


def test_without_roots_symlinks_anywhere_still_load(sharded, tmp_path, tensors):
    elsewhere = tmp_path / "elsewhere.safetensors"
    (sharded / "b.safetensors").rename(elsewhere)
    (sharded / "b.safetensors").symlink_to(elsewhere)
    assert {n for n, _ in iter_safetensors(str(sharded))} == set(tensors)
    assert set(disk_source.read_specs(str(sharded))) == set(tensors)
    with pytest.raises(OutsideRootsError, match="'b.safetensors'"):
        list(iter_safetensors(str(sharded), roots=[str(sharded)]))
    with pytest.raises(OutsideRootsError):
        disk_source.read_specs(str(sharded), roots=[str(sharded)])
    found = disk_source.read_specs(str(sharded), roots=[str(tmp_path)])  # both under tmp_path
    read = disk_source.read_tensors(found, list(found), str(sharded), [str(tmp_path)])
    assert len(read) == len(tensors)


def test_the_open_file_itself_is_checked_not_only_its_name(sharded, tmp_path, monkeypatch):
    """A symlink swapped in after the name was checked is still caught: the check is repeated
    on the file actually opened. Simulated by a name check that sees no symlinks."""
    outside = tmp_path / "outside.safetensors"
    (sharded / "b.safetensors").rename(outside)
    (sharded / "b.safetensors").symlink_to(outside)
    real_realpath = os.path.realpath
    unresolved = lambda p: real_realpath(p) if p == str(sharded) else os.path.abspath(p)  # noqa: E731
    monkeypatch.setattr(loader.os.path, "realpath", unresolved)
    with pytest.raises(OutsideRootsError):
        with open_checked(str(sharded / "b.safetensors"), "shard 'b.safetensors'", [str(sharded)]):
            pass


def test_files_that_are_not_regular_are_refused(sharded):
    os.mkfifo(sharded / "fifo.safetensors")  # opening it for reading would block forever
    _renamed(sharded, "b.safetensors", "fifo.safetensors")
    with pytest.raises(ValueError, match="not a regular file"):
        disk_source.read_specs(str(sharded), roots=[str(sharded)])


def test_a_path_outside_the_roots_while_paused_drops_every_staged_update(admin, dirs, tiny_qwen3, tensors):
    root, outside = dirs
    good = _write(root / "staged-good", tiny_qwen3, {**tensors, NAME: tensors[NAME] * 2})
    version, weights = admin.get_weight_version(), admin.get_weights_by_name(NAME)
    reference = admin.generate("roots", GREEDY)["output_ids"]
    admin.pause_generation(mode="in_place")
    try:
        assert admin.update_weights_from_disk(str(good), weight_version="staged")["staged"]
        refused = "model_path .* is not under an allowed root.*every update staged since the pause was rolled back"
        with pytest.raises(PermissionError, match=refused):
            admin.update_weights_from_disk(str(outside / "ckpt"))
        assert admin.get_server_info()["weight_update_staged"] == 0
    finally:
        admin.continue_generation()
    assert admin.get_weight_version() == version
    assert admin.get_weights_by_name(NAME) == weights
    assert admin.generate("roots", GREEDY)["output_ids"] == reference
