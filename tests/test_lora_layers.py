"""LoRA adapters on our models against PEFT (CPU, float32): a batch mixing base rows and three
adapters of different ranks and targets gives, row for row, PEFT's logits for that adapter
through prefill and decode; load/unload/replace cycles leave outputs right; each
tensor-parallel rank's slots hold its slices and add up to the whole model's delta."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from lora_helpers import Cache, make_peft_adapter, peft_model, run
from transformers import AutoConfig

from rollout.forward.forward_batch import ForwardMode
from rollout.forward.tensor_parallel import TPGroup
from rollout.models.loader import load_model
from rollout.models.lora import AdapterSlots

pytest.importorskip("peft")

TOL = 1e-4
# name: (r, lora_alpha, target_modules, other LoraConfig fields)
ADAPTERS = {
    "a": (2, 4, "all-linear", {}),
    "b": (4, 16, ["q_proj", "v_proj"], {"use_rslora": True}),
    "c": (8, 8, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {}),
}
BATCH = [None, "a", "b", "c"]  # the adapter of each request of the mixed batch
LENS = (7, 12, 5, 9)


@dataclass
class Setup:
    base: str
    config: object
    paths: dict[str, str]
    seqs: list[list[int]]
    want: dict[str | None, list[torch.Tensor]]  # adapter -> PEFT's logits of every sequence


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def setup(request, tmp_path_factory) -> Setup:
    base = request.getfixturevalue(request.param)
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    paths = {
        name: make_peft_adapter(base, str(root / name), r, alpha, targets, seed=i, **kw)
        for i, (name, (r, alpha, targets, kw)) in enumerate(ADAPTERS.items())
    }
    config = AutoConfig.from_pretrained(base)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, config.vocab_size, (n,), generator=gen).tolist() for n in LENS]
    want = {}
    for name in [None, *ADAPTERS]:
        model = peft_model(base, None if name is None else paths[name])
        with torch.no_grad():
            want[name] = [model(torch.tensor([s])).logits[0] for s in seqs]
    return Setup(base, config, paths, seqs, want)


def serve(setup: Setup, names=ADAPTERS, tp: TPGroup | None = None, **kw):
    model = load_model(setup.base, setup.config, torch.float32, "cpu", **({"tp": tp} if tp else {}))
    slots = AdapterSlots(model, kw.pop("max_loras_per_batch", 4), kw.pop("max_lora_rank", 8), **kw)
    for name in names:
        slots.load_path(name, setup.paths[name])
    return model, slots


def prefill_then_decode(model, slots, setup: Setup, adapters, rows) -> list[torch.Tensor]:
    """Logits of every token of setup.seqs[rows], each row on its adapter: a prefill of all
    but the last token, then one decode step."""
    seqs = [setup.seqs[i] for i in rows]
    cache = Cache(setup.config, len(seqs))
    prefill = run(model, slots, cache, [s[:-1] for s in seqs], [0] * len(seqs), adapters)
    decode = run(
        model, slots, cache, seqs, [len(s) - 1 for s in seqs], adapters, ForwardMode.DECODE
    )
    return [torch.cat([p, d]) for p, d in zip(prefill, decode)]


@pytest.mark.parametrize("fused", [False, True])
def test_lora_beside_the_gemms_gives_the_logits_of_lora_after_them(setup, fused, monkeypatch):
    """The kernels' path with LoRA run beside the GEMMs (AdapterSlots.run_beside): gate/up's,
    o_proj's and down_proj's deltas are added by the SiLU-and-mul and norms after them (the
    fused kernels, or the torch path), every other layer's after its GEMM: the same logits as
    every layer adding its own, and each left delta taken."""
    pytest.importorskip("triton")
    from rollout.models.layers import RMSNorm, SiluAndMulMLP
    from rollout.models.lora_layer import LoraLayer

    model, slots = serve(setup, use_kernels=True)
    for module in model.modules():
        if isinstance(module, (RMSNorm, SiluAndMulMLP)):
            module.fused = fused
    layers = model.model.layers
    for i, layer in enumerate(layers):  # linked where the next kernel reads the output
        mlp, norm = layer.mlp, layer.post_attention_layernorm
        assert mlp.gate_up_proj.lora.defers and mlp.down_proj.lora.defers
        assert norm.lora_delta is layer.self_attn.o_proj.lora and norm.lora_delta.defers
        before = layers[i - 1].mlp.down_proj.lora if i else None
        assert layer.input_layernorm.lora_delta is before
        assert not layer.self_attn.qkv_proj.lora.defers
    assert model.model.norm.lora_delta is layers[-1].mlp.down_proj.lora
    want = prefill_then_decode(model, slots, setup, BATCH, range(4))
    taken = []
    take = LoraLayer.take_delta
    monkeypatch.setattr(LoraLayer, "take_delta", lambda self: taken.append(take(self)) or taken[-1])
    slots.run_beside(64)  # the prefill (29 rows) and the decode (4) both
    got = prefill_then_decode(model, slots, setup, BATCH, range(4))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    # per forward: each layer's gate/up, o_proj and down_proj deltas
    assert sum(t is not None for t in taken) == 2 * 3 * len(layers)
    assert all(layer._owed is None for layer in slots.layers.values())
    slots.detach(model)
    assert all(getattr(m, "lora_delta", None) is None for m in model.modules())


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


def test_a_mixed_batch_matches_peft_row_for_row(setup):
    model, slots = serve(setup)
    got = prefill_then_decode(model, slots, setup, BATCH, range(len(BATCH)))
    for i, name in enumerate(BATCH):
        assert max_err(got[i], setup.want[name][i]) <= TOL, name
        if name is not None:  # the adapter matters: it is not compared against the base
            assert max_err(setup.want[name][i], setup.want[None][i]) > 1e-2, name


def test_each_request_alone_equals_its_row_of_the_mixed_batch(setup):
    model, slots = serve(setup)
    mixed = prefill_then_decode(model, slots, setup, BATCH, range(len(BATCH)))
    for i, name in enumerate(BATCH):
        alone = prefill_then_decode(model, slots, setup, [name], [i])[0]
        assert max_err(alone, mixed[i]) <= 1e-5, name


def test_one_sequence_on_every_adapter_in_one_batch(setup):
    model, slots = serve(setup)
    got = prefill_then_decode(model, slots, setup, BATCH, [1] * len(BATCH))
    for row, name in zip(got, BATCH):
        assert max_err(row, setup.want[name][1]) <= TOL, name


def test_unload_and_reload_cycles_leave_outputs_unchanged(setup):
    model, slots = serve(setup)
    before = prefill_then_decode(model, slots, setup, BATCH, range(len(BATCH)))
    slot_b = slots.slot_of("b")
    slots.unload("b")
    assert "b" not in slots.loaded
    # Rows still pointing at the freed slot add nothing: it is zeroed.
    slots.batch.prepare(torch.full((3,), slot_b, dtype=torch.int32))
    for layer in slots.layers.values():
        x = torch.randn(3, layer.a.shape[-1])
        assert not layer.apply(x, torch.zeros(3, layer.b.shape[1])).any()
    with pytest.raises(ValueError, match="no LoRA adapter named 'b' is loaded"):
        prefill_then_decode(model, slots, setup, ["b"], [2])
    for _ in range(2):
        slots.unload("a")
        slots.load_path("a", setup.paths["a"])
    slots.load_path("b", setup.paths["b"])
    after = prefill_then_decode(model, slots, setup, BATCH, range(len(BATCH)))
    for got, want in zip(after, before):
        assert max_err(got, want) <= 1e-6


def test_loading_over_a_name_replaces_that_adapter_in_its_slot(setup):
    model, slots = serve(setup, names=["a"])
    slot = slots.slot_of("a")
    slots.load("a", slots.read(setup.paths["c"]))  # a new version of "a": c's weights
    assert slots.loaded == {"a": slot}
    got = prefill_then_decode(model, slots, setup, ["a", None], [3, 0])
    assert max_err(got[0], setup.want["c"][3]) <= TOL
    assert max_err(got[1], setup.want[None][0]) <= TOL


@pytest.mark.parametrize("size", [2, 4])  # at 4 ranks each KV head is on two ranks
def test_tensor_parallel_ranks_hold_their_slices_and_sum_to_the_whole_delta(setup, size):
    _, whole = serve(setup)
    served = [serve(setup, tp=TPGroup(r, size)) for r in range(size)]
    ranks = [slots for _, slots in served]
    for model, _ in served:  # a partial sum's delta is added before its all-reduce: only
        for layer in model.model.layers:  # gate/up's may be left to the kernel after it
            assert layer.mlp.gate_up_proj.lora.defers
            assert not layer.self_attn.o_proj.lora.defers and not layer.mlp.down_proj.lora.defers
            assert layer.post_attention_layernorm.lora_delta is None
            assert layer.input_layernorm.lora_delta is None
    gen = torch.Generator().manual_seed(1)
    batch = [-1, 0, 1, 2, 1, -1, 2]  # slots of "a", "b", "c" in load order
    for slots in [whole, *ranks]:
        slots.batch.prepare(torch.tensor(batch, dtype=torch.int32))
    for name, layer in whole.layers.items():
        x = torch.randn(len(batch), layer.a.shape[-1], generator=gen)
        want = layer.apply(x, torch.zeros(len(batch), layer.b.shape[1]))
        parts = [slots.layers[name] for slots in ranks]
        if parts[0].a_shard is not None:  # row-parallel: partial deltas from input slices
            got = sum(p.apply(p.a_shard.take(x), torch.zeros_like(want)) for p in parts)
            assert max_err(got, want) <= 1e-5, name
            continue
        for p in parts:  # column-parallel: this rank's rows of each projection
            got = p.apply(x, torch.zeros(len(batch), p.b.shape[1]))
            for (first, size_), part in zip(p.part_rows, p.part_names):
                whole_first, _ = layer.part_rows[p.part_names.index(part)]
                shard = p.b_shards.get(part)
                lo = whole_first + (0 if shard is None else shard.start)
                assert max_err(got[:, first : first + size_], want[:, lo : lo + size_]) <= 1e-5
