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


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_serving_after_the_warm_up_compiles_nothing(tiny_qwen3, dtype):
    with RolloutEngine(tiny_qwen3, dtype=dtype, device="cuda", max_total_tokens=20000) as engine:
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
    before, after = ready["kernel_compiles_by_kernel"], served["kernel_compiles_by_kernel"]
    compiled = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert compiled == {}, f"compiled after the warm-up: {compiled}"
