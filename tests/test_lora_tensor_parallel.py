"""LoRA adapters at tensor parallelism 2 (CPU, gloo, float32, tiny Qwen3): every rank holds its
slices of the adapter slots, so a two-rank engine serves what a one-rank engine serves: a batch
mixing base rows and two adapters gives the same greedy tokens and logprobs, through unloads
and reloads, adapter updates of each source (tensor, gloo broadcast, disk, staged while
paused) and refused updates, which change no rank. In one process, with rank 1's handlers
called as across processes: each rank holds its own slices after a load or an update, and a
load or update that rank 1 refuses changes no rank."""

from __future__ import annotations

import os

import pytest
import torch
from lora_helpers import make_peft_adapter
from safetensors.torch import load_file
from server_helpers import free_port
from test_tensor_parallel_weights import FakeEngine, InProcessRanks
from transformers import AutoConfig

from rollout import RolloutEngine
from rollout.config import WeightSyncOptions
from rollout.engine.control_calls import CALLS
from rollout.engine.lora_manager import LoraManager
from rollout.errors import InvalidRequest, WeightSyncError
from rollout.forward.tensor_parallel import TPGroup
from rollout.lora_options import LoraOptions
from rollout.models.loader import load_model
from rollout.models.lora import AdapterSlots
from rollout.weight_sync.adapter_ranks import ADAPTER_LOAD, RankAdapters
from rollout.weight_sync.adapter_update import AdapterUpdates
from rollout.weight_sync.calls import (
    ContinueGeneration,
    DiscardStagedWeights,
    PauseGeneration,
    UpdateWeightsFromDisk,
    UpdateWeightsFromTensor,
)
from rollout.weight_sync.controller import WeightSyncController
from rollout.weight_sync.rank_weights import RankWeights

pytest.importorskip("peft")

NEW = 6
GREEDY = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
PROMPTS = [[5, 9, 13, 17, 21, 25, 29], [40, 41, 42, 43], list(range(60, 90))]
MIXED = [None, "a", "b"]  # the adapter of each request of a mixed batch, per prompt
# name: (r, lora_alpha, target_modules); "t", "d" and "k" are new values of "a"'s layout.
ADAPTERS = {
    "a": (4, 8, "all-linear"),
    "b": (8, 16, ["q_proj", "k_proj", "v_proj", "down_proj"]),
    "t": (4, 8, "all-linear"),
    "d": (4, 8, "all-linear"),
    "k": (4, 8, "all-linear"),
}


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora-tp")
    return {
        name: make_peft_adapter(tiny_qwen3, str(root / name), r, alpha, targets, seed=30 + i)
        for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())
    }


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def _mixed(engine) -> list[tuple[list[int], list[float]]]:
    """(tokens, logprobs) of every prompt on every adapter of MIXED, in one batch."""
    names = [name for _ in PROMPTS for name in MIXED]
    prompts = [p for p in PROMPTS for _ in MIXED]
    outs = engine.generate(
        input_ids=prompts, sampling_params=GREEDY, lora_path=names, return_logprob=True
    )
    return [
        (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        for o in outs
    ]


def _scenario(engine, adapters: dict[str, str]) -> dict[str, list]:
    """The same calls on any engine; what it served after each."""
    seen = {"start": _mixed(engine)}
    engine.unload_lora_adapter("b")
    with pytest.raises(InvalidRequest, match="no LoRA adapter named 'b'"):
        engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, lora_path="b")
    seen["unloaded"] = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora_path="a")
    engine.load_lora_adapter("b", adapters["b"])
    seen["reloaded"] = _mixed(engine)

    engine.update_weights_from_tensor(_tensors(adapters["t"]), weight_version="t", lora_name="a")
    seen["tensor"] = _mixed(engine)
    bad = dict(_tensors(adapters["d"]))
    first = next(iter(bad))
    bad[first] = bad[first].T.contiguous()
    with pytest.raises(InvalidRequest, match="has shape"):
        engine.update_weights_from_tensor(bad, weight_version="bad", lora_name="a")
    seen["refused"] = _mixed(engine)

    from rollout.weight_sync.sender import WeightSender

    sender = WeightSender(engine, method="distributed")  # the group counts every engine rank
    sender.init_group("127.0.0.1", free_port(), backend="gloo", group_name="lora", timeout_s=60)
    try:
        sender.push(_tensors(adapters["d"]), weight_version="d", lora_name="a")
    finally:
        sender.close()
    seen["distributed"] = _mixed(engine)

    engine.pause_generation(mode="in_place")
    engine.update_weights_from_tensor(_tensors(adapters["t"]), weight_version="x", lora_name="a")
    assert engine.discard_staged_weights()["discarded"] == 1
    engine.update_weights_from_disk(adapters["k"], weight_version="k", lora_name="a")
    engine.continue_generation()
    seen["staged"] = _mixed(engine)
    seen["versions"] = engine.get_server_info()["lora_weight_versions"]
    return seen


def _engine(path: str, tp: int, adapters: dict[str, str]) -> RolloutEngine:
    engine = RolloutEngine(
        path, dtype="float32", device="cpu", max_total_tokens=2048, tp_size=tp,
        lora_paths=[f"a={adapters['a']}"], max_lora_rank=8, max_loras_per_batch=2,
    )  # fmt: skip
    engine.load_lora_adapter("b", adapters["b"])
    return engine


@pytest.fixture(scope="module")
def one_rank(tiny_qwen3, adapters) -> dict[str, list]:
    with _engine(tiny_qwen3, 1, adapters) as engine:
        return _scenario(engine, adapters)


@pytest.fixture(scope="module")
def two_ranks(tiny_qwen3, adapters) -> dict[str, list]:
    with _engine(tiny_qwen3, 2, adapters) as engine:
        return _scenario(engine, adapters)


def _assert_same(want: list, got: list) -> None:
    for (ids_w, lp_w), (ids_g, lp_g) in zip(want, got, strict=True):
        assert ids_g == ids_w
        assert lp_g == pytest.approx(lp_w, abs=1e-4)


def test_a_mixed_batch_at_two_ranks_serves_what_one_rank_does(one_rank, two_ranks):
    _assert_same(one_rank["start"], two_ranks["start"])
    # Each adapter changes what is served (else the comparison would prove little).
    start = one_rank["start"]
    for k in range(len(PROMPTS)):
        base, on_a, on_b = (start[k * len(MIXED) + j][1] for j in range(len(MIXED)))
        assert on_a != pytest.approx(base, abs=1e-3) and on_b != pytest.approx(base, abs=1e-3)


def test_unload_and_reload_at_two_ranks(one_rank, two_ranks):
    assert [o["output_ids"] for o in two_ranks["unloaded"]] == [
        o["output_ids"] for o in one_rank["unloaded"]
    ]
    _assert_same(two_ranks["start"], two_ranks["reloaded"])


@pytest.mark.parametrize("step", ["tensor", "refused", "distributed", "staged"])
def test_adapter_updates_at_two_ranks_serve_what_one_rank_does(one_rank, two_ranks, step):
    _assert_same(one_rank[step], two_ranks[step])


def test_updates_change_what_is_served_and_refusals_do_not(two_ranks):
    assert two_ranks["tensor"] != two_ranks["reloaded"]
    _assert_same(two_ranks["tensor"], two_ranks["refused"])
    assert two_ranks["distributed"] != two_ranks["tensor"]
    assert two_ranks["versions"] == {"a": "k", "b": "default"}


# ---- in one process: rank 0's calls and rank 1's handlers, each over its own shard ----------
class AdapterEngine(FakeEngine):
    """The EnginePort of one rank, with its LoraManager."""

    def __init__(self, model, config, lora: LoraManager) -> None:
        super().__init__(model, config)
        self.adapters = lora

    def publish_adapter_version(self, name: str, version: str | None) -> str:
        return self.adapters.publish(name, version)


@pytest.fixture
def ranks(tiny_qwen3, adapters):
    """(rank 0's controller, both ranks' engines, rank 1's handlers, rank 1's RankAdapters):
    loads, unloads and updates from rank 0 reach rank 1 as across processes."""
    config = AutoConfig.from_pretrained(tiny_qwen3)
    options = LoraOptions(
        lora_paths=(f"a={adapters['a']}",), max_lora_rank=8, max_loras_per_batch=2
    )
    engines = []
    for rank in (0, 1):
        model = load_model(tiny_qwen3, config, torch.float32, "cpu", tp=TPGroup(rank, 2))
        engines.append(AdapterEngine(model, config, LoraManager(model, options, False)))
    weight_options = WeightSyncOptions()
    controller = WeightSyncController(engines[0], weight_options)
    weights1 = RankWeights(engines[1], weight_options, CALLS, rank=1, size=2)
    adapters1 = RankAdapters(AdapterUpdates(engines[1], lambda: weights1.local), CALLS, 1)
    handlers = {**weights1.handlers(), **adapters1.handlers()}
    others = InProcessRanks(handlers)
    controller.use_other_ranks(others)
    engines[0].adapters.use_other_ranks(others)
    return controller, engines, handlers, adapters1


def _slot_values(engine) -> dict[str, tuple[torch.Tensor, ...]]:
    layers = engine.adapters.slots.layers
    return {n: (x.a.clone(), x.b.clone(), x.scales.clone()) for n, x in layers.items()}


def _holds(engine, rank: int, name: str, directory: str, tiny_qwen3) -> bool:
    """Does `engine` (tensor-parallel rank `rank` of 2) hold adapter `directory` in `name`'s
    slot: its own slices of it, as a fresh load of that rank's slots would?"""
    config = AutoConfig.from_pretrained(tiny_qwen3)
    model = load_model(tiny_qwen3, config, torch.float32, "cpu", tp=TPGroup(rank, 2))
    fresh = AdapterSlots(model, 2, 8)
    slot = engine.adapters.slots.slot_of(name)
    fresh.load(name, fresh.read(directory))
    got, want = engine.adapters.slots.layers, fresh.layers
    return all(
        torch.equal(got[n].a[slot], want[n].a[0]) and torch.equal(got[n].b[slot], want[n].b[0])
        for n in want
    )


def test_rank_0_loads_and_unloads_on_every_rank_or_on_none(ranks, adapters, tiny_qwen3):
    _, engines, _, _ = ranks
    engines[0].adapters.load("b", adapters["b"], None)
    assert all(e.adapters.is_loaded("b") for e in engines)
    assert _holds(engines[1], 1, "b", adapters["b"], tiny_qwen3)
    engines[0].adapters.unload("b", [])
    assert not any(e.adapters.is_loaded("b") for e in engines)
    # Rank 1 has no free slot (an adapter only it holds): it refuses, and rank 0 unloads.
    engines[1].adapters.load("x", adapters["t"], None)
    with pytest.raises(
        InvalidRequest, match="tensor-parallel rank 1 failed loading LoRA adapter 'b'.*slots"
    ):
        engines[0].adapters.load("b", adapters["b"], None)
    assert not engines[0].adapters.is_loaded("b") and engines[0].adapters.slots.loaded == {"a": 0}


def test_an_update_reaches_each_ranks_slices(ranks, adapters, tiny_qwen3):
    controller, engines, _, _ = ranks
    with UpdateWeightsFromTensor.shared(
        _tensors(adapters["t"]), weight_version="t", lora_name="a"
    ) as call:
        assert controller.run(call)["weight_version"] == "t"
    for rank, engine in enumerate(engines):
        assert _holds(engine, rank, "a", adapters["t"], tiny_qwen3)
    # Staged while paused: kept on every rank until continue_generation, or dropped.
    controller.run(PauseGeneration(mode="in_place"))
    with UpdateWeightsFromTensor.shared(_tensors(adapters["d"]), lora_name="a") as call:
        assert controller.run(call)["staged"]
    assert len(ranks[3].kept) == 1
    assert controller.run(DiscardStagedWeights())["discarded"] == 1
    assert not ranks[3].kept
    controller.run(UpdateWeightsFromDisk(adapters["k"], lora_name="a"))
    assert all(_holds(e, r, "a", adapters["t"], tiny_qwen3) for r, e in enumerate(engines))
    controller.run(ContinueGeneration())
    assert all(_holds(e, r, "a", adapters["k"], tiny_qwen3) for r, e in enumerate(engines))


def test_an_update_rank_1_fails_to_receive_changes_no_rank(ranks, adapters, monkeypatch):
    controller, engines, handlers, adapters1 = ranks
    before = [_slot_values(e) for e in engines]

    def failed(*args):
        return {"error": {"kind": "weight_sync", "message": "injected: the transfer broke"}}

    monkeypatch.setitem(handlers, ADAPTER_LOAD, failed)
    with UpdateWeightsFromTensor.shared(_tensors(adapters["t"]), lora_name="a") as call:
        with pytest.raises(WeightSyncError, match="tensor-parallel rank 1 failed .*injected"):
            controller.run(call)
    for engine, values in zip(engines, before):
        after = _slot_values(engine)
        assert all(all(torch.equal(x, y) for x, y in zip(after[n], values[n])) for n in values)
    assert engines[0].adapters.version_of("a") == "default" and not adapters1.kept
