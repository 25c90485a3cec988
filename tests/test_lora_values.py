"""New values of a loaded adapter written into its slots (AdapterSlots.write_values, what an
adapter push ends in), against a load of the same values: repeated updates of the same names
and shapes (their check and slot views kept from the first) leave every tensor-parallel rank's
slots as a load of those values does, at and below max_lora_rank, from another dtype; an
adapter loaded again under its name, or a changed set of names, is checked afresh."""

from __future__ import annotations

import pytest
import torch
from lora_helpers import make_peft_adapter
from transformers import AutoConfig

from rollout.forward.tensor_parallel import TPGroup
from rollout.models.loader import load_model
from rollout.models.lora import AdapterError, AdapterSlots, LoraAdapter

pytest.importorskip("peft")

PREFIX = "base_model.model."
TARGETS = ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"]


@pytest.fixture(scope="module")
def dirs(tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    """Rank 4 and rank 8 adapters of the same modules."""
    root = tmp_path_factory.mktemp("lora-values")
    return {
        f"r{r}": make_peft_adapter(tiny_qwen3, str(root / f"r{r}"), r, 2 * r, TARGETS, seed=r)
        for r in (4, 8)
    }


def slots_with(base: str, path: str, max_rank: int = 8, tp: TPGroup | None = None) -> AdapterSlots:
    config = AutoConfig.from_pretrained(base)
    model = load_model(base, config, torch.float32, "cpu", **({"tp": tp} if tp else {}))
    slots = AdapterSlots(model, 2, max_rank)
    slots.load_path("x", path)
    return slots


def new_values(adapter: LoraAdapter, seed: int, modules=None) -> dict[str, torch.Tensor]:
    """PEFT-named random values for `modules` (default all) of `adapter`."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for module in modules or adapter.modules:
        a, b = adapter.modules[module]
        out[f"{PREFIX}{module}.lora_A.weight"] = torch.randn(a.shape, generator=gen)
        out[f"{PREFIX}{module}.lora_B.weight"] = torch.randn(b.shape, generator=gen)
    return out


def with_values(adapter: LoraAdapter, values: dict[str, torch.Tensor]) -> LoraAdapter:
    """`adapter` with the modules of `values` replaced by them."""
    modules = dict(adapter.modules)
    for module in {n.removeprefix(PREFIX).rsplit(".lora_", 1)[0] for n in values}:
        a, b = (values[f"{PREFIX}{module}.lora_{k}.weight"].float() for k in "AB")
        modules[module] = (a, b)
    return LoraAdapter(adapter.rank, adapter.scale, modules)


def assert_same_slots(got: AdapterSlots, want: AdapterSlots) -> None:
    for name, layer in want.layers.items():
        mine = got.layers[name]
        for field in ("a", "b", "scales"):
            assert torch.equal(getattr(mine, field), getattr(layer, field)), (name, field)


@pytest.mark.parametrize("size, max_rank", [(1, 8), (1, 4), (2, 8)])
def test_repeated_updates_leave_the_slots_as_a_load_of_their_values(
    tiny_qwen3, dirs, size, max_rank
):
    for rank in range(size):
        tp = TPGroup(rank, size) if size > 1 else None
        slots, ref = (slots_with(tiny_qwen3, dirs["r4"], max_rank, tp) for _ in range(2))
        adapter = slots.read(dirs["r4"])
        for seed in (1, 2, 1):  # the same names and shapes every time
            values = new_values(adapter, seed)
            assert slots.write_values("x", list(values.items())) == len(adapter.modules)
            ref.load("x", with_values(adapter, values))
            assert_same_slots(slots, ref)
        # Other dtypes are cast into the slots; the kept layout is the same.
        half = {n: t.to(torch.bfloat16) for n, t in new_values(adapter, 3).items()}
        slots.write_values("x", list(half.items()))
        ref.load("x", with_values(adapter, half))
        assert_same_slots(slots, ref)
        # A partial update changes only its modules.
        module = next(iter(adapter.modules))
        part = new_values(adapter, 4, [module])
        assert slots.write_values("x", list(part.items())) == 1
        ref.load("x", with_values(with_values(adapter, half), part))
        assert_same_slots(slots, ref)


def test_an_adapter_loaded_again_under_its_name_is_checked_afresh(tiny_qwen3, dirs):
    slots = slots_with(tiny_qwen3, dirs["r4"])
    r4, r8 = slots.read(dirs["r4"]), slots.read(dirs["r8"])
    old = list(new_values(r4, 1).items())
    slots.write_values("x", old)
    slots.unload("x")
    with pytest.raises(AdapterError, match="no LoRA adapter named 'x'"):
        slots.write_values("x", old)
    slots.load("x", r8)  # the same name and modules, at rank 8
    with pytest.raises(AdapterError, match=r"has shape \[4, .*expected \[8, "):
        slots.write_values("x", old)
    new = new_values(r8, 2)
    slots.write_values("x", list(new.items()))
    ref = slots_with(tiny_qwen3, dirs["r8"])
    ref.load("x", with_values(r8, new))
    assert_same_slots(slots, ref)
    slots.load("x", r4)  # loading over the name (a disk update) as well
    with pytest.raises(AdapterError, match="has shape"):
        slots.write_values("x", list(new.items()))
    slots.write_values("x", old)
    ref.load("x", with_values(r4, dict(old)))
    assert_same_slots(slots, ref)


def test_a_changed_set_of_names_is_checked_afresh_and_changes_nothing(tiny_qwen3, dirs):
    slots = slots_with(tiny_qwen3, dirs["r4"])
    adapter = slots.read(dirs["r4"])
    values = new_values(adapter, 1)
    slots.write_values("x", list(values.items()))  # its check and views are kept
    before = {name: (layer.a.clone(), layer.b.clone()) for name, layer in slots.layers.items()}
    a_name = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"
    v_name = a_name.replace("q_proj", "v_proj")  # a projection the adapter does not adapt
    cases = {
        "without its lora_B": {a_name: values[a_name]},
        "has shape": {**values, a_name: values[a_name][:, :-1]},
        "has no LoRA weights on": {**values, v_name: values[a_name]},
        "unexpected tensor": {**values, "model.embed_tokens.weight": torch.zeros(4, 4)},
    }
    for message, named in cases.items():
        with pytest.raises(AdapterError, match=message):
            slots.write_values("x", list(named.items()))
    for name, layer in slots.layers.items():
        assert torch.equal(layer.a, before[name][0]) and torch.equal(layer.b, before[name][1])
    slots.write_values("x", list(new_values(adapter, 2).items()))  # the first names again
    ref = slots_with(tiny_qwen3, dirs["r4"])
    ref.load("x", with_values(adapter, new_values(adapter, 2)))
    assert_same_slots(slots, ref)
