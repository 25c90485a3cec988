"""Tensor parallelism on a GPU: two ranks sharing one GPU over gloo (eager) against one rank,
through the GPU kernels (Triton/FlashInfer attention, fused norms and rotary, the sampling
kernel). NCCL between GPUs is measured where two GPUs are lent (benchmarks --tp-size)."""

from __future__ import annotations

import random

import pytest
import torch

from rollout import RolloutEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _generate(path: str, tp: int, backend: str) -> tuple[list[dict], list[dict]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(3, 90))] for _ in range(6)]
    # Ranks sharing a GPU share its memory too: a KV pool of a fixed size for each.
    options = dict(
        dtype="float32",
        device="cuda",
        attention_backend=backend,
        disable_cuda_graph=True,
        max_total_tokens=4096,
    )
    if tp > 1:
        options.update(tp_size=tp, tp_backend="gloo", gpu_ids=[0] * tp)
    with RolloutEngine(path, **options) as engine:
        greedy = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        sampled = engine.generate(
            input_ids=prompts,
            sampling_params={
                "temperature": 1.0,
                "max_new_tokens": 12,
                "seed": 5,
                "ignore_eos": True,
            },
        )
    return greedy, sampled


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_two_ranks_on_one_gpu_generate_what_one_rank_does(fixture, backend, request):
    path = request.getfixturevalue(fixture)
    one, two = _generate(path, 1, backend), _generate(path, 2, backend)
    for a, b in zip(one[0], two[0]):
        assert a["output_ids"] == b["output_ids"]
        lps_a = [e[0] for e in a["meta_info"]["output_token_logprobs"]]
        lps_b = [e[0] for e in b["meta_info"]["output_token_logprobs"]]
        assert lps_b == pytest.approx(lps_a, abs=1e-4)
    assert [o["output_ids"] for o in one[1]] == [o["output_ids"] for o in two[1]]


def test_a_weight_update_reaches_both_ranks_on_one_gpu(tiny_qwen3, tiny_qwen3_perturbed):
    from safetensors.torch import load_file

    new = load_file(f"{tiny_qwen3_perturbed}/model.safetensors", device="cuda")
    prompts = [[5, 6, 7, 8], list(range(10, 60))]
    outs = []
    for tp in (1, 2):
        options = dict(
            dtype="float32", device="cuda", disable_cuda_graph=True, max_total_tokens=4096
        )
        if tp > 1:
            options.update(tp_size=tp, tp_backend="gloo", gpu_ids=[0] * tp)
        with RolloutEngine(tiny_qwen3, **options) as engine:
            engine.update_weights_from_tensor(new, weight_version="v1")  # CUDA IPC handles
            out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            name = "model.layers.0.self_attn.q_proj.weight"
            rows = engine.get_weights_by_name(name, truncate_size=4)
        assert torch.equal(torch.tensor(rows), new[name][:4].cpu())
        assert all(o["meta_info"]["weight_version"] == "v1" for o in out)
        outs.append([o["output_ids"] for o in out])
    assert outs[0] == outs[1]
