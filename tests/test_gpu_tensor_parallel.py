"""Tensor parallelism on GPUs against one rank, through the GPU kernels (Triton/FlashInfer
attention, fused norms and rotary, the sampling kernel): two ranks sharing one GPU over gloo
(eager), and, where two GPUs are lent, two ranks on two GPUs over NCCL, eager and from CUDA
graphs that capture the all-reduce; a weight update through CUDA IPC handles at two ranks that
one rank refuses changes neither. (Speed at tp 2: benchmarks --tp-size 2.)"""

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


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def _generate(
    path: str, tp: int, backend: str, plan: dict | None = None, **extra
) -> tuple[list[dict], list[dict]]:
    """(greedy outputs with logprobs, seeded sampled outputs) of six prompts; `plan`, when
    given, is filled with the engine's kernel plan."""
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
    options.update(extra)
    with RolloutEngine(path, **options) as engine:
        if plan is not None:
            plan.update(engine.get_server_info()["kernel_plan"])
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
    _assert_same(_generate(path, 1, backend), _generate(path, 2, backend))


@two_gpus
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_two_gpus_over_nccl_generate_what_one_gpu_does(fixture, backend, graphs, request):
    path = request.getfixturevalue(fixture)
    graph_options = {"disable_cuda_graph": not graphs}
    one = _generate(path, 1, backend, **graph_options)
    two = _generate(
        path, 2, backend, tp_size=2, tp_backend="nccl", gpu_ids=None, **graph_options
    )  # fmt: skip
    _assert_same(one, two)


@two_gpus
@pytest.mark.parametrize("min_rows", [1, 64], ids=["every-step", "prefills"])
def test_sums_in_symmetric_memory_generate_what_nccl_sums_do(tiny_qwen3, min_rows):
    """symm_mem_allreduce_min_rows: at 64 rows the prefills (up to ~540 rows) are summed with
    torch's two-shot all-reduce, o_proj and down_proj writing into the symmetric buffer, and
    the decodes over NCCL; at 1 every step, the decode CUDA graphs capturing the sum."""
    nccl = {"tp_size": 2, "tp_backend": "nccl", "gpu_ids": None, "disable_cuda_graph": False}
    plain = _generate(tiny_qwen3, 2, "auto", **nccl)
    plan: dict = {}
    symm = _generate(tiny_qwen3, 2, "auto", plan, symm_mem_allreduce_min_rows=min_rows, **nccl)
    assert plan["symm_mem_allreduce_min_rows"] == min_rows and plan["cuda_graphs"]
    _assert_same(plain, symm)


def _assert_same(one: tuple[list[dict], list[dict]], two: tuple[list[dict], list[dict]]) -> None:
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


@two_gpus
def test_per_rank_handles_at_two_gpus_commit_on_both_ranks_or_on_neither(
    tiny_qwen3, tiny_qwen3_perturbed
):
    from safetensors.torch import load_file

    from rollout.weight_sync.tensor_handles import share_tensors

    new = load_file(f"{tiny_qwen3_perturbed}/model.safetensors")
    prompts = [[5, 6, 7, 8], list(range(10, 60))]
    options = dict(dtype="float32", device="cuda", max_total_tokens=4096)
    with RolloutEngine(tiny_qwen3_perturbed, **options) as engine:
        expected = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    # Each rank's set on its own GPU, as a trainer sharded like the engine sends them.
    good = [[(n, t.to(f"cuda:{r}")) for n, t in new.items()] for r in range(2)]
    name, last = good[1][-1][0], good[1][-1][1]
    bad = good[1][:-1] + [(name, torch.zeros(3, device="cuda:1"))]  # rank 1's set alone is wrong
    with RolloutEngine(tiny_qwen3, tp_size=2, tp_backend="nccl", **options) as engine:
        # From scratch each time (a prefix-cache hit changes logprobs in the last bits).
        engine.flush_cache()
        before = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        refused = [share_tensors(good[0]), share_tensors(bad)]
        try:
            with pytest.raises(ValueError, match="tensor-parallel rank 1"):
                engine.update_weights_from_tensor([s.handles for s in refused], weight_version="no")
        finally:
            for s in refused:
                s.close()
        engine.flush_cache()
        again = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        assert [o["output_ids"] for o in again] == [o["output_ids"] for o in before]
        assert [o["meta_info"]["output_token_logprobs"] for o in again] == [
            o["meta_info"]["output_token_logprobs"] for o in before
        ]
        assert engine.get_weight_version() == "default"
        sent = [share_tensors(good[0]), share_tensors(good[1])]
        try:
            engine.update_weights_from_tensor([s.handles for s in sent], weight_version="v1")
        finally:
            for s in sent:
                s.close()
        out = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        rows = engine.get_weights_by_name(name, truncate_size=4)
    assert [o["output_ids"] for o in out] == expected
    assert all(o["meta_info"]["weight_version"] == "v1" for o in out)
    assert torch.equal(torch.tensor(rows), last[:4].cpu())
