"""The LoRA layers as a captured decode CUDA graph sees them (CPU: the kernels under Triton's
interpreter, and the torch path). A graph keeps the tensors its kernels read at capture and
the launches it recorded; each step must then only rewrite those tensors in place. Here a
"graph" is a forward run with the batch tensors taken at capture: across steps whose rows
switch adapters, with padding rows, and after an adapter is unloaded and another loaded into
its slot, it adds what an eager forward of the step's rows adds, nothing on padding rows, and
its kernels launch exactly as at capture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

pytest.importorskip("triton")

import rollout_kernels.lora_expand as expand_module  # noqa: E402
import rollout_kernels.lora_shrink as shrink_module  # noqa: E402
from rollout.models.loader import load_model  # noqa: E402
from rollout.models.lora import AdapterSlots, LoraAdapter  # noqa: E402

GRAPH_SIZES = (4, 8)
# Each step's requests (one decode row each): the adapter of each, None for the base model.
STEPS = [
    ["a", None, "b"],
    ["b", "b", "a", None, "a"],
    [None, None],
    ["a", "b", "a", "b", "a", "b", "a", "b"],
]
AFTER_SWAP = [["c", None, "b", "c"], ["b", "c", None, "c", "c", "b"]]  # "a" unloaded, "c" loaded


def random_adapter(shapes: dict, rank: int, modules: str, seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    picked = {}
    for module, (out_features, in_features) in shapes.items():
        if module.rsplit(".", 1)[1] in modules:
            a = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            b = torch.randn(out_features, rank, generator=gen) / rank**0.5
            picked[module] = (a, b)
    return LoraAdapter(rank, 2.0 / rank, picked)


class LaunchLog:
    """Records every launch of a Triton kernel: its grid and its non-tensor arguments (a
    captured graph replays these as they were at capture)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            scalars = tuple(a for a in args if not torch.is_tensor(a))
            shapes = tuple(tuple(a.shape) for a in args if torch.is_tensor(a))
            self.launches.append((tuple(grid), scalars, shapes, tuple(sorted(kwargs.items()))))
            return launch(*args, **kwargs)

        return run


@pytest.fixture(params=[True, False], ids=["kernels", "torch"])
def served(request, tiny_qwen3, device, monkeypatch):
    config = AutoConfig.from_pretrained(tiny_qwen3)
    model = load_model(tiny_qwen3, config, torch.float32, device)
    slots = AdapterSlots(model, 3, 8, use_kernels=request.param)
    shapes = slots.module_shapes
    adapters = {
        "a": random_adapter(
            shapes, 4, "q_proj k_proj v_proj o_proj gate_proj up_proj down_proj", 1
        ),
        "b": random_adapter(shapes, 8, "q_proj v_proj down_proj", 2),
        "c": random_adapter(shapes, 2, "k_proj o_proj up_proj", 3),
    }
    slots.load("a", adapters["a"])
    slots.load("b", adapters["b"])
    logs = {}
    for module, name in (
        (shrink_module, "_lora_shrink_kernel"),
        (expand_module, "_lora_expand_kernel"),
    ):
        logs[name] = LaunchLog(getattr(module, name))
        monkeypatch.setattr(module, name, logs[name])
    return slots, adapters, logs


def device_of(slots: AdapterSlots) -> torch.device:
    return next(iter(slots.layers.values())).a.device


def capture(slots: AdapterSlots, bs: int) -> tuple:
    """What a graph of `bs` rows holds of the LoRA batch (the CUDA graph runner captures with
    every row base-only)."""
    slots.batch.prepare(torch.full((bs,), -1, dtype=torch.int32, device=device_of(slots)), True)
    return slots.batch.slots, slots.batch.segments


def replay(slots: AdapterSlots, graph: tuple, layer, x: torch.Tensor, out: torch.Tensor):
    """The layer's forward as the graph runs it: over the tensors taken at capture."""
    batch = slots.batch
    prepared = (batch.slots, batch.segments)
    assert batch.slots.data_ptr() == graph[0].data_ptr()  # rewritten in place
    if graph[1] is not None:
        for field in ("order", "seg_start", "seg_len", "block_end"):
            assert getattr(prepared[1], field).data_ptr() == getattr(graph[1], field).data_ptr()
    batch.slots, batch.segments, batch.active = graph[0], graph[1], True
    try:
        return layer.apply(x, out)
    finally:
        batch.slots, batch.segments = prepared


def test_a_captured_forward_replays_any_mix_of_adapters_with_padding(served):
    slots, adapters, logs = served
    graphs, at_capture = {}, {}
    for bs in reversed(GRAPH_SIZES):
        graphs[bs] = capture(slots, bs)
        for log in logs.values():
            log.launches.clear()
        for layer in slots.layers.values():
            x, out = torch.zeros(bs, layer.a.shape[-1]), torch.zeros(bs, layer.b.shape[1])
            layer.apply(x.to(layer.a.device), out.to(layer.a.device))
        at_capture[bs] = {name: list(log.launches) for name, log in logs.items()}
    gen = torch.Generator().manual_seed(0)

    def check(steps):
        for names in steps:
            b = len(names)
            bs = min(size for size in GRAPH_SIZES if size >= b)
            replayed = {name: [] for name in logs}
            for layer in slots.layers.values():
                x = torch.randn(bs, layer.a.shape[-1], generator=gen).to(layer.a.device)
                out = torch.randn(bs, layer.b.shape[1], generator=gen).to(layer.a.device)
                slots.prepare_batch(names, [1] * b)  # eager: the step's rows alone
                want = layer.apply(x[:b], out[:b].clone())
                slots.prepare_batch(names, [1] * b)  # graph: the rows, padded to its size
                slots.batch.pad_to(bs)
                for log in logs.values():
                    log.launches.clear()
                got = replay(slots, graphs[bs], layer, x, out.clone())
                for name, log in logs.items():
                    replayed[name] += log.launches
                torch.testing.assert_close(got[:b], want, atol=1e-5, rtol=1e-5)
                assert torch.equal(got[b:], out[b:])  # padding rows: no delta
                if any(n is not None for n in names):
                    assert not torch.allclose(want, out[:b])  # the adapters do change rows
            if slots.batch.use_kernels:
                assert replayed == at_capture[bs]

    check(STEPS)
    slot_a = slots.slot_of("a")
    slots.unload("a")
    assert slots.load("c", adapters["c"]) == slot_a  # copied into the freed slot
    check(AFTER_SWAP)


def test_pad_to_needs_the_batch_in_its_persistent_buffers(served):
    slots, _, _ = served
    slots.prepare_batch(["a", None], [1, 1])
    with pytest.raises(ValueError, match="pad_to\\(1\\)"):
        slots.batch.pad_to(1)  # fewer rows than prepared
    slots.batch.prepare(torch.zeros(slots.batch.max_tokens + 1, dtype=torch.int32))  # any device
    with pytest.raises(ValueError, match="persistent buffers"):
        slots.batch.pad_to(slots.batch.max_tokens + 1)


def test_compile_kernels_launches_each_class_and_leaves_the_adapters_as_they_were(served):
    # The engine runs it before serving: one batch of each launch class through every layer,
    # so that no prefill compiles a kernel variant later; it must change no output.
    slots, _, logs = served
    layer = next(iter(slots.layers.values()))
    dev = device_of(slots)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, layer.a.shape[-1], generator=gen).to(dev)
    out = torch.randn(3, layer.b.shape[1], generator=gen).to(dev)
    slots.prepare_batch(["a", None, "b"], [1, 1, 1])
    before = layer.apply(x, out.clone())
    for log in logs.values():
        log.launches.clear()
    slots.compile_kernels()
    if slots.batch.use_kernels:
        assert not slots.batch.active  # nothing prepared: the runner prepares each forward
        classes = shrink_module.LAUNCH_CLASS_ROWS
        rows = sorted({shapes[0][0] for *_, shapes, _ in logs["_lora_shrink_kernel"].launches})
        assert rows == list(classes)
        block_m = {dict(kw)["BLOCK_M"] for *_, kw in logs["_lora_expand_kernel"].launches}
        assert block_m == {16, 64}  # a long prefill's blocks too
        assert len(logs["_lora_expand_kernel"].launches) == len(classes) * len(slots.layers)
    else:
        assert all(not log.launches for log in logs.values())
    slots.prepare_batch(["a", None, "b"], [1, 1, 1])
    torch.testing.assert_close(layer.apply(x, out.clone()), before)
