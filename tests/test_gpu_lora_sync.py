"""Adapter pushes through CUDA IPC (GPU): WeightSender's kept bucket, pushed step after step
(the engine's kept check and slot views, one batched copy), and tensors of another dtype each
under its own handle (cast by the batched copy) serve what the same values loaded from a PEFT
directory serve, at an adapter rank below max_lora_rank and equal to it."""

from __future__ import annotations

import os

import pytest
import torch
from lora_helpers import make_peft_adapter
from safetensors.torch import load_file

from rollout import RolloutEngine
from rollout.weight_sync.sender import WeightSender

pytest.importorskip("peft")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_RANK = 8
PROMPTS = [[3 + (7 * i + j) % 700 for j in range(5 + 3 * i)] for i in range(4)]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_qwen3, tmp_path_factory) -> dict[str, str]:
    """Adapters "<name><rank>": a is loaded, b and c are pushed."""
    root = tmp_path_factory.mktemp("gpu-lora-sync")
    return {
        f"{name}{r}": make_peft_adapter(
            tiny_qwen3, str(root / f"{name}{r}"), r, 2 * r, "all-linear", seed=60 + 10 * r + i
        )
        for r in (4, MAX_RANK)
        for i, name in enumerate("abc")
    }


def served(engine, lora: str) -> tuple[list, list]:
    outs = engine.generate(
        input_ids=PROMPTS, sampling_params=GREEDY, lora_path=[lora] * len(PROMPTS),
        return_logprob=True,
    )  # fmt: skip
    ids = [o["output_ids"] for o in outs]
    logprobs = [lp for o in outs for lp, _, _ in o["meta_info"]["output_token_logprobs"]]
    return ids, logprobs


def assert_same(engine, pushed: str, loaded: str) -> None:
    got, want = served(engine, pushed), served(engine, loaded)
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


# FlashInfer's 16-bit prefill has no kernel for the tiny models' head_dim: Triton's attention.
@pytest.mark.parametrize(("dtype", "backend"), [("float32", "auto"), ("bfloat16", "triton")])
@pytest.mark.parametrize("rank", [4, MAX_RANK])
def test_pushed_adapters_serve_as_the_same_values_loaded_from_a_directory(
    tiny_qwen3, adapters, dtype, backend, rank
):
    start = adapters[f"a{rank}"]
    with RolloutEngine(
        tiny_qwen3, dtype=dtype, device="cuda", max_total_tokens=4096, attention_backend=backend,
        lora_paths=[f"pushed={start}", f"loaded={start}"], max_lora_rank=MAX_RANK,
        max_loras_per_batch=2,
    ) as engine:  # fmt: skip
        sender = WeightSender(engine, method="tensor", lora_name="pushed")
        try:
            for step, name in enumerate("bcb"):  # the same names and shapes every push
                path = adapters[f"{name}{rank}"]
                weights = load_file(os.path.join(path, "adapter_model.safetensors"), "cuda")
                sender.push(weights, weight_version=f"step-{step}")
                engine.update_weights_from_disk(path, lora_name="loaded")
                assert_same(engine, "pushed", "loaded")
        finally:
            sender.close()
        # Float32 tensors, each under its own handle, into bfloat16 slots: the batched copy
        # casts them as a load of the (float32) directory does.
        if dtype == "bfloat16":
            path = adapters[f"c{rank}"]
            weights = load_file(os.path.join(path, "adapter_model.safetensors"), "cuda")
            engine.update_weights_from_tensor(weights, lora_name="pushed")
            engine.update_weights_from_disk(path, lora_name="loaded")
            assert_same(engine, "pushed", "loaded")
