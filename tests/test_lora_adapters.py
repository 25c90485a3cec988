"""Reading PEFT adapters: a bad adapter (wrong shapes, unknown module, rank above
max_lora_rank, features beyond plain LoRA) is a clear error that changes no slot; the slot
store's own limits; PEFT's other spellings of the same adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lora_helpers import make_peft_adapter, peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig

from rollout.models.loader import OutsideRootsError, load_model
from rollout.models.lora import AdapterSlots
from rollout.models.lora_adapter import (
    AdapterError,
    adapter_from_tensors,
    parse_adapter_config,
    resolve_target_modules,
)

pytest.importorskip("peft")

Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def good(tiny_llama, tmp_path_factory) -> str:
    """An all-linear rank-4 adapter of tiny_llama (hidden 64, 2 layers)."""
    out = str(tmp_path_factory.mktemp("good-adapter"))
    return make_peft_adapter(tiny_llama, out, 4, 8, "all-linear", seed=0)


@pytest.fixture
def model(tiny_llama):
    return load_model(tiny_llama, AutoConfig.from_pretrained(tiny_llama), torch.float32, "cpu")


def edit_config(**fields):
    def edit(config, tensors):
        config.update(fields)

    return edit


def set_tensor(name, shape):
    def edit(config, tensors):
        tensors[name] = torch.zeros(shape)

    return edit


def drop_tensor(name):
    def edit(config, tensors):
        del tensors[name]

    return edit


BAD = {
    "rank above max": (edit_config(r=16), "rank 16 is above max_lora_rank 8"),
    "unknown target module": (
        edit_config(target_modules=["q_proj", "lm_head"]),
        "unknown target module\\(s\\) lm_head",
    ),
    "A of the wrong input size": (
        set_tensor(f"{Q0}.lora_A.weight", (4, 65)),
        r"lora_A.weight has shape \[4, 65\], expected \[4, 64\]",
    ),
    "B of another rank": (
        set_tensor(f"{Q0}.lora_B.weight", (64, 3)),
        r"lora_B.weight has shape \[64, 3\], expected \[64, 4\]",
    ),
    "A without B": (drop_tensor(f"{Q0}.lora_B.weight"), "q_proj has no lora_B weight"),
    "a LoRA on the LM head": (
        set_tensor("base_model.model.lm_head.lora_A.weight", (4, 64)),
        "LoRA on lm_head is not supported",
    ),
    "a layer the model lacks": (
        set_tensor("base_model.model.model.layers.5.mlp.up_proj.lora_A.weight", (4, 64)),
        "the model has no projection model.layers.5.mlp.up_proj",
    ),
    "a tensor target_modules omits": (
        edit_config(target_modules=["q_proj", "v_proj"]),
        "omits (k_proj|o_proj|gate_proj|up_proj|down_proj)",
    ),
    "bias": (edit_config(bias="all"), "bias='all' \\(trained bias terms\\) is not supported"),
    "DoRA": (edit_config(use_dora=True), "use_dora=True \\(DoRA\\) is not supported"),
    "modules_to_save": (edit_config(modules_to_save=["lm_head"]), "modules_to_save="),
    "rank_pattern": (edit_config(rank_pattern={"q_proj": 2}), "per-module ranks"),
    "another PEFT method": (edit_config(peft_type="IA3"), "peft_type must be LORA"),
}


def write_bad(good: str, out, edit) -> str:
    shutil.copytree(good, out)
    with open(out / "adapter_config.json") as f:
        config = json.load(f)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    edit(config, tensors)
    with open(out / "adapter_config.json", "w") as f:
        json.dump(config, f)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return str(out)


def snapshot(slots: AdapterSlots) -> list[torch.Tensor]:
    state = [slots.batch.ranks.clone()]
    for layer in slots.layers.values():
        state += [layer.a.clone(), layer.b.clone(), layer.scales.clone()]
    return state


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_adapter_is_a_clear_error_and_changes_nothing(model, good, tmp_path, case):
    edit, message = BAD[case]
    bad = write_bad(good, tmp_path / "bad", edit)
    slots = AdapterSlots(model, max_loras_per_batch=2, max_lora_rank=8)
    slots.load_path("good", good)
    before = snapshot(slots)
    for name in ("good", "new"):  # neither a replacement nor a new adapter
        with pytest.raises(AdapterError, match=message):
            slots.load_path(name, bad)
    assert slots.loaded == {"good": 0}
    assert all(torch.equal(x, y) for x, y in zip(before, snapshot(slots)))


def test_missing_files_and_pickles_are_named(model, good, tmp_path):
    slots = AdapterSlots(model, 1, 8)
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        slots.read(str(tmp_path))
    shutil.copytree(good, tmp_path / "bin")
    (tmp_path / "bin" / "adapter_model.safetensors").rename(tmp_path / "bin" / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="safe_serialization=True"):
        slots.read(str(tmp_path / "bin"))
    (tmp_path / "bin" / "adapter_model.safetensors").write_bytes(b"")
    (tmp_path / "bin" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        slots.read(str(tmp_path / "bin"))
    shutil.copy(f"{good}/adapter_config.json", tmp_path / "bin" / "adapter_config.json")
    weights = tmp_path / "bin" / "adapter_model.safetensors"
    weights.write_bytes((tmp_path / "bin" / "adapter_model.bin").read_bytes()[:100])  # cut short
    with pytest.raises(AdapterError, match="adapter_model.safetensors is not a safetensors file"):
        slots.read(str(tmp_path / "bin"))
    with pytest.raises(OutsideRootsError):
        slots.read(good, roots=[str(tmp_path)])


def test_the_store_limits_are_clear_errors(model, good):
    slots = AdapterSlots(model, max_loras_per_batch=1, max_lora_rank=4)
    slots.load_path("one", good)
    with pytest.raises(AdapterError, match="all 1 LoRA slots .* in use by one: unload"):
        slots.load_path("two", good)
    with pytest.raises(AdapterError, match="no LoRA adapter named 'two' is loaded"):
        slots.unload("two")
    slots.detach(model)
    only_qv = AdapterSlots(model, 2, 8, target_modules="q_proj,v_proj")
    with pytest.raises(AdapterError, match="which lora_target_modules \\(q_proj, v_proj\\)"):
        only_qv.load_path("all", good)
    assert set(only_qv.layers) == {f"model.layers.{i}.self_attn.qkv_proj" for i in range(2)}
    only_qv.detach(model)
    small = AdapterSlots(model, 1, 2)
    with pytest.raises(ValueError, match="already has LoRA slots: detach them first"):
        AdapterSlots(model, 1, 2)
    with pytest.raises(AdapterError, match="rank 4 is above max_lora_rank 2"):
        small.read(good)
    small.detach(model)
    with pytest.raises(ValueError, match="lora_target_modules must be 'all' or names"):
        resolve_target_modules("q_proj,lm_head")
    assert resolve_target_modules(["all"]) == resolve_target_modules("all-linear")
    for layer in model.modules():
        assert getattr(layer, "lora", None) is None  # detach took every slot off


def test_live_peft_names_and_a_regex_target_read_as_the_saved_adapter(model, tiny_llama, tmp_path):
    # What a trainer holds: a PeftModel's parameters, named with the adapter ("default").
    path = make_peft_adapter(tiny_llama, str(tmp_path / "qv"), 2, 4, r".*\.(q_proj|v_proj)", 1)
    slots = AdapterSlots(model, 1, 8)
    saved = slots.read(path)
    assert saved.projections == {"q_proj", "v_proj"} and len(saved.modules) == 4
    live = peft_model(tiny_llama, path)
    tensors = [(n, p.detach()) for n, p in live.named_parameters() if ".lora_" in n]
    assert tensors[0][0].endswith(".lora_A.default.weight")
    with open(f"{path}/adapter_config.json") as f:
        config = parse_adapter_config(json.load(f), max_rank=8)
    synced = adapter_from_tensors(config, tensors, slots.module_shapes)
    assert synced.modules.keys() == saved.modules.keys() and synced.scale == saved.scale == 2.0
    for module, (a, b) in saved.modules.items():
        assert torch.equal(a, synced.modules[module][0]) and torch.equal(
            b, synced.modules[module][1]
        )
