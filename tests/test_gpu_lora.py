"""LoRA decode replayed from CUDA graphs (GPU): an engine with adapters captures its decode
graphs with the LoRA layers in them, and serves what the same engine serves with graphs off,
token for token, while the rows of each step switch adapters (requests of different lengths
finish at different steps), and after adapters are loaded into slots once the graphs exist."""

from __future__ import annotations

import random

import pytest
import torch
from lora_helpers import make_peft_adapter

from rollout import RolloutEngine

pytest.importorskip("peft")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# name: (r, lora_alpha, target_modules); "c" and "d" are loaded after the graphs are captured.
ADAPTERS = {
    "a": (4, 8, "all-linear"),
    "b": (16, 16, ["q_proj", "v_proj", "down_proj"]),
    "c": (8, 32, ["k_proj", "o_proj", "gate_proj", "up_proj"]),
    "d": (2, 4, "all-linear"),
}


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gpu-lora")
    return {
        name: make_peft_adapter(tiny_qwen3, str(root / name), r, alpha, targets, seed=40 + i)
        for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items())
    }


def _requests(names: list[str | None], seed: int) -> tuple[list, list, list]:
    """Prompts, per-request sampling params of different lengths, and adapters."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 800) for _ in range(rng.randint(3, 40))] for _ in names]
    params = [
        {"temperature": 0, "max_new_tokens": rng.randint(4, 24), "ignore_eos": True} for _ in names
    ]
    return prompts, params, names


def _serve(engine, requests) -> list[tuple[list[int], list[float]]]:
    prompts, params, names = requests
    outs = engine.generate(
        input_ids=prompts, sampling_params=params, lora_path=names, return_logprob=True
    )
    return [
        (o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]])
        for o in outs
    ]


def _scenario(engine, adapters: dict[str, str]) -> list:
    rows = [None, "a", "b", "a", None, "b", "b", "a", None, "a", "b"]
    served = [_serve(engine, _requests(rows, seed=0))]
    engine.load_lora_adapter("c", adapters["c"])  # into a free slot, after capture
    served.append(_serve(engine, _requests(["c", "a", None, "c", "b", "c"], seed=1)))
    engine.unload_lora_adapter("b")
    engine.load_lora_adapter("d", adapters["d"])  # into b's slot
    served.append(_serve(engine, _requests(["d", "c", "a", None, "d"] * 5, seed=2)))
    return served


# FlashInfer's 16-bit prefill has no kernel for the tiny models' head_dim: Triton's attention.
@pytest.mark.parametrize(("dtype", "backend"), [("float32", "auto"), ("bfloat16", "triton")])
def test_lora_decode_from_cuda_graphs_equals_eager_decode(tiny_qwen3, adapters, dtype, backend):
    served = {}
    for graphs in (True, False):
        with RolloutEngine(
            tiny_qwen3, dtype=dtype, device="cuda", max_total_tokens=4096,
            lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"], max_lora_rank=16,
            max_loras_per_batch=3, disable_cuda_graph=not graphs, cuda_graph_max_bs=32,
            attention_backend=backend,
        ) as engine:  # fmt: skip
            assert engine.get_server_info()["kernel_plan"]["cuda_graphs"] is graphs
            served[graphs] = _scenario(engine, adapters)
    _assert_same_served(served[True], served[False], dtype, tol=1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.parametrize(("dtype", "backend"), [("float32", "auto"), ("bfloat16", "triton")])
def test_lora_beside_the_gemms_serves_what_lora_after_them_serves(tiny_qwen3, adapters, dtype, backend):
    """lora_overlap_max_rows: decode batches (in graphs) and short prefills run LoRA on a second
    stream, the deltas of gate/up, o_proj and down_proj added by the kernels after them."""
    served = {}
    for rows in (128, 0):
        with RolloutEngine(
            tiny_qwen3, dtype=dtype, device="cuda", max_total_tokens=4096,
            lora_paths=[f"a={adapters['a']}", f"b={adapters['b']}"], max_lora_rank=16,
            max_loras_per_batch=3, cuda_graph_max_bs=32, attention_backend=backend,
            lora_overlap_max_rows=rows,
        ) as engine:  # fmt: skip
            assert engine.get_server_info()["kernel_plan"]["lora_overlap_max_rows"] == rows
            served[rows] = _scenario(engine, adapters)
    # float32: a GPU may round the delta's multiply-add once where the other path rounds twice
    _assert_same_served(served[128], served[0], dtype, tol=1e-4 if dtype == "float32" else 2e-2)


def _assert_same_served(got: list, want: list, dtype: str, tol: float) -> None:
    for run_got, run_want in zip(got, want, strict=True):
        for (ids_g, lp_g), (ids_w, lp_w) in zip(run_got, run_want, strict=True):
            if dtype != "float32":  # 16-bit rounding may flip a near-tie: up to the first difference
                same = next((k for k, (x, y) in enumerate(zip(ids_g, ids_w)) if x != y), None)
                ids_g, ids_w, lp_g, lp_w = (v[:same] for v in (ids_g, ids_w, lp_g, lp_w))
            assert ids_g == ids_w
            assert lp_g == pytest.approx(lp_w, abs=tol)


def test_adapters_change_what_the_graphs_serve(tiny_qwen3, adapters):
    prompts, params, _ = _requests([None] * 4, seed=3)
    with RolloutEngine(
        tiny_qwen3, dtype="float32", device="cuda", max_total_tokens=4096,
        lora_paths=[f"a={adapters['a']}"], max_lora_rank=16, max_loras_per_batch=2,
    ) as engine:  # fmt: skip
        assert engine.get_server_info()["kernel_plan"]["cuda_graphs"]
        base = _serve(engine, (prompts, params, [None] * 4))
        on_a = _serve(engine, (prompts, params, ["a"] * 4))
        mixed = _serve(engine, (prompts, params, [None, "a", None, "a"]))
    assert all(b[1] != pytest.approx(a[1], abs=1e-3) for b, a in zip(base, on_a))
    for k, row in enumerate(mixed):
        want = on_a[k] if k % 2 else base[k]
        assert row[0] == want[0] and row[1] == pytest.approx(want[1], abs=1e-4)
