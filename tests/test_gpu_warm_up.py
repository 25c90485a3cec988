"""On a GPU the engine compiles its kernels before it reports ready: serving the usual mix of
requests afterwards builds no Triton kernel variant (get_server_info's kernel_compiles)."""

from __future__ import annotations

import pytest
import torch

from rollout import RolloutEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SAMPLINGS = [
    {"temperature": 1.0},
    {"temperature": 0},
    {"temperature": 0.8, "top_k": 20},
    {"temperature": 0.8, "top_p": 0.9},
    {"temperature": 0.8, "min_p": 0.05},
    {"temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 0.8, "repetition_penalty": 1.2, "frequency_penalty": 0.3},
    {"temperature": 0.8, "logit_bias": {"3": 2.0}},
]


@pytest.mark.parametrize(
    "dtype, options",
    [
        ("bfloat16", {}),
        ("float32", {}),
        ("bfloat16", {"large_decode_min_batch": 33, "large_decode_piece_keys": 0}),
        ("bfloat16", {"large_decode_min_batch": 33, "large_decode_piece_keys": 16}),
    ],
    ids=["bfloat16", "float32", "bfloat16-unsplit", "bfloat16-pieces"],
)
def test_serving_after_the_warm_up_compiles_nothing(tiny_qwen3, dtype, options):
    with RolloutEngine(
        tiny_qwen3, dtype=dtype, device="cuda", max_total_tokens=20000, **options
    ) as engine:
        ready = engine.get_server_info()
        assert ready["warmup_s"] > 0
        prefix = list(range(5, 69))
        for params in SAMPLINGS:
            prompts = [[7 + i, 9, 11 + i % 5] for i in range(48)]  # rows enough for the kernels
            engine.generate(
                input_ids=prompts, sampling_params={**params, "max_new_tokens": 6, "ignore_eos": True},
                return_logprob=True, top_logprobs_num=2,
            )  # fmt: skip
        for extra in ([80, 81], [90, 91, 92, 93]):  # a cached prefix, extended
            engine.generate(input_ids=prefix + extra, sampling_params={"max_new_tokens": 3})
        served = engine.get_server_info()
    compiled = _compiled_since(ready, served)
    assert compiled == {}, f"compiled after the warm-up: {compiled}"


def _compiled_since(ready: dict, served: dict) -> dict:
    before, after = ready["kernel_compiles_by_kernel"], served["kernel_compiles_by_kernel"]
    return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}


def test_lora_prefills_of_every_size_compile_nothing_after_the_warm_up(tiny_qwen3, tmp_path):
    # LoRA's kernels launch differently by batch size (a decode batch, a prefill, a prefill
    # past 1,024 rows in blocks of 64): the engine compiles each before it is ready.
    pytest.importorskip("peft")
    from lora_helpers import make_peft_adapter

    adapter = make_peft_adapter(tiny_qwen3, str(tmp_path / "a"), 8, 16, "all-linear", seed=3)
    with RolloutEngine(
        tiny_qwen3, dtype="bfloat16", device="cuda", max_total_tokens=20000,
        enable_lora=True, lora_paths=[f"a={adapter}"], max_lora_rank=8,
    ) as engine:  # fmt: skip
        ready = engine.get_server_info()
        params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        for num, length in ((1, 5), (3, 30), (2, 200), (8, 190)):  # up to 1,520 rows at once
            prompts = [[(7 + 11 * i + j) % 900 + 3 for j in range(length)] for i in range(num)]
            names = ["a" if i % 2 == 0 else None for i in range(num)]
            engine.generate(input_ids=prompts, sampling_params=params, lora_path=names)
        served = engine.get_server_info()
    compiled = _compiled_since(ready, served)
    assert compiled == {}, f"compiled after the warm-up: {compiled}"
