"""Weight sync at tensor parallelism 2 (CPU, gloo, float32): every update path reaches every
rank's shard, commits on all ranks or on none, and reads back the full tensors.

The first tests drive rank 0's controller and rank 1's handlers in one process (each over its
own shard; loading needs no communication between ranks), where a failure can be injected on
rank 1 alone. The rest run a two-rank RolloutEngine and compare with transformers."""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hf_reference import hf_greedy
from safetensors.torch import load_file
from transformers import AutoConfig

from rollout import RolloutEngine
from rollout.config import WeightSyncOptions
from rollout.engine.control_calls import CALLS
from rollout.errors import InvalidRequest, WeightSyncError
from rollout.forward.tensor_parallel import TPGroup
from rollout.models.loader import load_model
from rollout.weight_sync.calls import (
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
    GetWeightsByName,
    PauseGeneration,
    UpdateWeightsFromDisk,
    UpdateWeightsFromTensor,
)
from rollout.weight_sync.controller import WeightSyncController
from rollout.weight_sync.deferred import in_thread
from rollout.weight_sync.rank_weights import RankWeights
from rollout.weight_sync.sender import WeightSender
from rollout.weight_sync.tensor_handles import share_tensors

NEW_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 800) for _ in range(n)] for n in (5, 17, 40)]
SHARDED = (
    "model.layers.0.self_attn.q_proj.weight",  # column-parallel: rows split
    "model.layers.1.self_attn.k_proj.weight",  # a slice of the fused QKV
    "model.layers.0.mlp.down_proj.weight",  # row-parallel: columns split
    "model.embed_tokens.weight",  # vocabulary rows, padded
    "model.norm.weight",  # whole on every rank
)


def _weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


# ---- in one process: rank 0's controller and rank 1's handlers ------------------------------
class FakeEngine:
    """An EnginePort with no requests: holds and versions are recorded, memory stays."""

    def __init__(self, model: torch.nn.Module, hf_config: Any) -> None:
        self.model, self.hf_config = model, hf_config
        self.device = torch.device("cpu")
        self.weight_version = "start"
        self.holds: set[str] = set()
        self.releases_memory, self.kv_cache_bytes = False, 0

    def hold(self, reason: str) -> None:
        self.holds.add(reason)

    def release_hold(self, reason: str) -> None:
        self.holds.discard(reason)

    def held_by(self) -> list[str]:
        return sorted(self.holds)

    def count_requests(self) -> int:
        return 0

    def abort_all(self) -> None:
        pass

    def retract_all(self) -> int:
        return 0

    def publish_weight_version(self, version: str, weights_changed: bool) -> None:
        self.weight_version = version

    def flush_prefix_cache(self) -> None:
        pass

    def release_region(self, tag: str) -> bool:
        return False

    def resume_region(self, tag: str) -> None:
        pass


@dataclass
class Answer:
    rank: int
    result: Any = None
    error: str | None = None


class InProcessRanks:
    """rank_sync.OtherRanks over rank 1's handlers in this process; arguments cross as JSON,
    as they must between processes."""

    size = 2

    def __init__(self, handlers: dict[str, Callable[..., Any]]) -> None:
        self.handlers = handlers

    def call(self, handler: str, *args: Any) -> Sequence[Answer]:
        return [Answer(1, self.handlers[handler](*json.loads(json.dumps(args))))]

    def start(self, handler: str, *args: Any) -> Callable[[], Sequence[Answer]]:
        return in_thread(lambda: self.call(handler, *args), handler).result


@pytest.fixture
def two_ranks(tiny_qwen3):
    """(rank 0's controller, rank 1's RankWeights) over the two shards of tiny_qwen3."""
    config = AutoConfig.from_pretrained(tiny_qwen3)
    models = [
        load_model(tiny_qwen3, config, torch.float32, "cpu", tp=TPGroup(r, 2)) for r in (0, 1)
    ]
    options = WeightSyncOptions()
    controller = WeightSyncController(FakeEngine(models[0], config), options)
    rank1 = RankWeights(FakeEngine(models[1], config), options, CALLS, rank=1, size=2)
    controller.use_other_ranks(InProcessRanks(rank1.handlers()))
    return controller, rank1


def test_rank_0_leaves_a_group_while_the_other_ranks_do(two_ranks, monkeypatch):
    """NCCL's shutdown of a group waits for every rank of it: rank 0 must not wait for its own
    before the other ranks were asked to leave (a tp 2 engine hung there on GPUs). A rank that
    fails to leave is named."""
    controller, _ = two_ranks
    events, ranks = [], controller.others.ranks
    start = ranks.start

    def recording_start(handler: str, *args: Any) -> Callable[[], Sequence[Answer]]:
        events.append(f"asked {handler}")
        wait = start(handler, *args)
        return lambda: (events.append(f"answered {handler}"), wait())[1]

    def leave_here(name: str) -> dict:
        events.append(f"rank 0 left {name}")
        return {"message": f"left {name!r}"}

    monkeypatch.setattr(ranks, "start", recording_start)
    monkeypatch.setattr(controller.groups, "leave", leave_here)
    with pytest.raises(WeightSyncError, match="rank 1 failed leaving: .*no weight update group 'g'"):
        controller.group_calls.destroy(DestroyWeightsUpdateGroup("g"))
    assert events == ["asked weights_leave", "rank 0 left g", "answered weights_leave"]


def test_rank_0_leaves_a_group_even_when_the_other_ranks_cannot_be_asked(two_ranks, monkeypatch):
    controller, _ = two_ranks
    left = []

    def unreachable(handler: str, *args: Any) -> Callable[[], Sequence[Answer]]:
        raise WeightSyncError("tensor-parallel ranks did not answer: the line is down")

    monkeypatch.setattr(controller.others.ranks, "start", unreachable)
    monkeypatch.setattr(controller.groups, "leave", lambda name: left.append(name) or {})
    with pytest.raises(WeightSyncError, match="did not answer"):
        controller.group_calls.destroy(DestroyWeightsUpdateGroup("g"))
    assert left == ["g"]


def _snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(model, snapshot: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(p, snapshot[n]) for n, p in model.named_parameters())


def _holds_slices_of(model, weights: dict[str, torch.Tensor]) -> bool:
    for name in model.hf_param_shapes():
        shard = model.hf_shard(name)
        want = weights[name] if shard is None else shard.take(weights[name])
        if not torch.equal(model.hf_weight(name), want):
            return False
    return True


def _fail_after(monkeypatch, model, loads: int) -> None:
    """Rank 1's model fails its load number `loads + 1`, after writing the first `loads`."""
    load, count = model.load_weights, [0]

    def failing(weights, presharded=False):
        count[0] += 1
        if count[0] > loads:
            raise RuntimeError("injected failure on rank 1")
        return load(weights, presharded=presharded)

    monkeypatch.setattr(model, "load_weights", failing)


def test_a_load_failing_on_rank_1_midway_rolls_back_both_ranks(
    two_ranks, tiny_qwen3_perturbed, monkeypatch
):
    controller, rank1 = two_ranks
    models = [controller.model, rank1.model]
    before = [_snapshot(m) for m in models]
    new = _weights(tiny_qwen3_perturbed)
    _fail_after(monkeypatch, rank1.model, loads=5)
    with UpdateWeightsFromTensor.shared(new, weight_version="bad") as call:
        with pytest.raises(WeightSyncError) as failed:
            controller.run(call)
    message = str(failed.value)
    assert "tensor-parallel rank 1" in message and "injected failure" in message
    assert "rolled back on every rank" in message
    assert all(_same(m, snap) for m, snap in zip(models, before))
    assert controller.versions.current == "start" and rank1.txn is None
    monkeypatch.undo()
    with UpdateWeightsFromTensor.shared(new, weight_version="good") as call:
        assert controller.run(call)["weight_version"] == "good"
    assert all(_holds_slices_of(m, new) for m in models)


def test_a_failure_on_rank_1_takes_down_the_updates_staged_while_paused(
    two_ranks, tiny_qwen3_perturbed, monkeypatch
):
    controller, rank1 = two_ranks
    models = [controller.model, rank1.model]
    before = [_snapshot(m) for m in models]
    new = list(_weights(tiny_qwen3_perturbed).items())
    controller.run(PauseGeneration("in_place"))
    with UpdateWeightsFromTensor.shared(new[:10], weight_version="part") as call:
        assert controller.run(call)["staged"]
    assert not _same(models[1], before[1])  # staged on rank 1 too, not yet committed
    _fail_after(monkeypatch, rank1.model, loads=3)
    with UpdateWeightsFromTensor.shared(new[10:]) as call:
        with pytest.raises(WeightSyncError, match="every update staged since the pause"):
            controller.run(call)
    assert all(_same(m, snap) for m, snap in zip(models, before))
    assert "weight_version" not in controller.run(ContinueGeneration())
    assert controller.versions.current == "start"


def test_disk_updates_load_each_ranks_slices(two_ranks, tiny_qwen3_perturbed):
    controller, rank1 = two_ranks
    out = controller.run(UpdateWeightsFromDisk(tiny_qwen3_perturbed, weight_version="disk"))
    assert out["weight_version"] == "disk"
    new = _weights(tiny_qwen3_perturbed)
    assert _holds_slices_of(controller.model, new) and _holds_slices_of(rank1.model, new)


def test_get_weights_by_name_gathers_the_first_rows_of_the_full_tensor(two_ranks, tiny_qwen3):
    controller, _ = two_ranks
    full = _weights(tiny_qwen3)
    for name in SHARDED:
        for rows in (3, 500, 100_000):
            got = torch.tensor(controller.run(GetWeightsByName(name, rows))["values"])
            assert torch.equal(got, full[name][:rows]), (name, rows)


def test_per_rank_handles_must_be_one_set_per_rank(two_ranks, tiny_qwen3_perturbed):
    controller, rank1 = two_ranks
    before = _snapshot(rank1.model)
    sent = [share_tensors(list(_weights(tiny_qwen3_perturbed).items())) for _ in range(3)]
    try:
        call = UpdateWeightsFromTensor([s.handles for s in sent])
        with pytest.raises(InvalidRequest, match="3 sets of handles.*2 tensor-parallel rank"):
            controller.run(call)
        assert _same(rank1.model, before)
        assert controller.run(UpdateWeightsFromTensor([s.handles for s in sent[:2]]))["success"]
    finally:
        for s in sent:
            s.close()
    assert _holds_slices_of(rank1.model, _weights(tiny_qwen3_perturbed))


# ---- through a two-rank engine ------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hf_greedy(path: str) -> list[list[int]]:
    return hf_greedy(path, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def expected(tiny_qwen3, tiny_qwen3_perturbed) -> dict[str, list[list[int]]]:
    return {"base": _hf_greedy(tiny_qwen3), "perturbed": _hf_greedy(tiny_qwen3_perturbed)}


@pytest.fixture(scope="module")
def engine(tiny_qwen3):
    with RolloutEngine(
        tiny_qwen3, dtype="float32", device="cpu", max_total_tokens=2048, tp_size=2
    ) as eng:
        yield eng


def _greedy(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _exact(engine) -> list:
    """Tokens and logprobs of each prompt alone, from scratch (bitwise comparable)."""
    outs = []
    for ids in PROMPTS:
        assert engine.flush_cache()["success"]
        out = engine.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
        outs.append((out["output_ids"], out["meta_info"]["output_token_logprobs"]))
    return outs


def _read_back(engine) -> dict[str, torch.Tensor]:
    return {n: torch.tensor(engine.get_weights_by_name(n, 100_000)) for n in SHARDED}


def test_every_update_path_reaches_both_ranks(engine, expected, tiny_qwen3, tiny_qwen3_perturbed):
    base, perturbed = _weights(tiny_qwen3), _weights(tiny_qwen3_perturbed)
    sender = WeightSender(engine, method="distributed")  # the group counts both engine ranks
    sender.init_group("127.0.0.1", _free_port(), backend="gloo", group_name="tp", timeout_s=30)
    try:
        assert engine.get_server_info()["weight_update_groups"] == ["tp"]
        sender.push(perturbed, weight_version="dist", load_format="flattened_bucket")
        assert _greedy(engine) == expected["perturbed"]
        assert engine.get_weight_version() == "dist"
    finally:
        sender.close()
    assert engine.get_server_info()["weight_update_groups"] == []

    engine.update_weights_from_tensor(base, weight_version="tensor")  # full tensors, one set
    assert _greedy(engine) == expected["base"]
    per_rank = [share_tensors(list(perturbed.items())) for _ in range(2)]
    try:
        engine.update_weights_from_tensor([s.handles for s in per_rank])
    finally:
        for s in per_rank:
            s.close()
    assert _greedy(engine) == expected["perturbed"]
    assert engine.get_weight_version() == "tensor"  # unnamed: the label is kept

    assert engine.update_weights_from_disk(tiny_qwen3, weight_version="disk")["success"]
    assert _greedy(engine) == expected["base"]
    got = _read_back(engine)
    assert all(torch.equal(got[n], base[n]) for n in SHARDED)


def test_an_update_refused_by_rank_1_alone_changes_no_rank(
    engine, tiny_qwen3, tiny_qwen3_perturbed
):
    engine.update_weights_from_disk(tiny_qwen3, weight_version="kept")
    before, weights = _exact(engine), _read_back(engine)
    good = list(_weights(tiny_qwen3_perturbed).items())
    bad = good[:-1] + [(good[-1][0], torch.zeros(3))]  # rank 1's set: one wrong shape
    sent = [share_tensors(good), share_tensors(bad)]
    try:
        with pytest.raises(ValueError, match="tensor-parallel rank 1.*must be"):
            engine.update_weights_from_tensor([s.handles for s in sent])
        engine.pause_generation("in_place")  # staged: both ranks load, then rank 1 refuses
        staged = engine.update_weights_from_tensor(good[:10], weight_version="staged")
        assert staged["staged"]
        with pytest.raises(ValueError, match="every update staged since the pause"):
            engine.update_weights_from_tensor([s.handles for s in sent])
        engine.continue_generation()
    finally:
        for s in sent:
            s.close()
    assert _exact(engine) == before and engine.get_weight_version() == "kept"
    got = _read_back(engine)
    assert all(torch.equal(got[n], weights[n]) for n in SHARDED)


def test_memory_is_released_and_resumed_on_both_ranks(engine):
    before = _greedy(engine)
    engine.release_memory_occupation(["kv_cache"])
    assert [r["kv_cache_bytes"] for r in engine.get_server_info()["ranks"]] == [0, 0]
    engine.resume_memory_occupation(["kv_cache"])
    assert all(r["kv_cache_bytes"] > 0 for r in engine.get_server_info()["ranks"])
    assert _greedy(engine) == before


def test_an_update_group_must_count_every_engine_rank(engine):
    with pytest.raises(ValueError, match="world_size must count every engine rank"):
        engine.init_weights_update_group("127.0.0.1", _free_port(), 1, 2, "small", "gloo", 5)
    assert engine.get_server_info()["weight_update_groups_joining"] == []


def test_a_failed_join_leaves_no_rank_behind(engine, expected, tiny_qwen3):
    with pytest.raises(WeightSyncError, match="could not join"):
        engine.init_weights_update_group("127.0.0.1", _free_port(), 1, 3, "retry", "gloo", 2)
    info = engine.get_server_info()
    assert info["weight_update_groups"] == [] and info["weight_update_groups_joining"] == []
    sender = WeightSender(engine, method="distributed")  # the same name joins on every rank
    sender.init_group("127.0.0.1", _free_port(), backend="gloo", group_name="retry", timeout_s=30)
    try:
        sender.push(_weights(tiny_qwen3), weight_version="after-retry")
    finally:
        sender.close()
    assert _greedy(engine) == expected["base"]
