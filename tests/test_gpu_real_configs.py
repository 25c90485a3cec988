"""bf16 on the real models' shapes: every attention backend's logprobs (and, on two GPUs, two
tensor-parallel ranks') as close to the exact (float32) ones as transformers' own bf16 run is,
or within 2e-2.

Random weights with each real config's dimensions (hidden size, heads, head dim, vocabulary,
rope settings), cut to a few layers for the two large models so that a checkpoint is written
in seconds. The engine generates greedily; transformers then scores the prompt plus the
engine's tokens, in bf16 and with the same weights in float32, so a near tie between two
tokens (random weights make many) cannot send the runs down different continuations.

Why not "within 2e-2 of transformers' bf16": on these shapes bf16 rounding alone moves
transformers' logprobs up to 0.026 (Qwen3-0.6B) and 0.063-0.068 (Qwen2.5-7B and Llama-3.1-8B
shapes) from the float32 ones (H100, 2026-11-24), and two bf16 implementations that round at
different places are each that far from the exact values, in different directions."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from rollout import RolloutEngine
from rollout.forward.attention import package_imports
from rollout.real_configs import REAL_CONFIGS
from rollout.tiny_model import write_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LAYERS = {"qwen3-0.6b": None, "qwen2.5-7b": 3, "llama-3.1-8b": 3}  # None: all of them
LOGPROB_TOL = 2e-2
TP_SPREAD = 1.6  # how much further bf16 tensor parallelism may stray (see the assertion)
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=list(LAYERS))
def real_checkpoint(request, tmp_path_factory):
    """(path, prompts, transformers in bf16, transformers in float32 with the same weights) for
    one real config with random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    name = request.param
    path = str(tmp_path_factory.mktemp(name))
    cfg = dict(REAL_CONFIGS[name])
    if LAYERS[name] is not None:
        cfg["num_hidden_layers"] = LAYERS[name]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_tokenizer(path)  # the engine is given token ids; the tokenizer only decodes
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    hf.save_pretrained(path, safe_serialization=True)
    hf.eval()
    # The same weights in float32: the logprobs bf16 rounding moves both runs away from.
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    rng = random.Random(1)
    prompts = [[rng.randrange(3, cfg["vocab_size"]) for _ in range(rng.randint(5, 300))] for _ in range(6)]
    yield path, prompts, hf, exact
    del hf, exact
    torch.cuda.empty_cache()


def _scores(model, ids: list[int], new: list[int]) -> torch.Tensor:
    """Logprobs under `model` of the tokens `new` after `ids`: [len(new)] float32."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + new], device="cuda")).logits[0, len(ids) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, torch.tensor(new, device="cuda")[:, None])[:, 0]


BACKENDS = {
    "flashinfer": {"attention_backend": "flashinfer"},  # Triton decode at small batches
    "flashinfer-decode": {"attention_backend": "flashinfer", "decode_attention_backend": "flashinfer"},
    "triton": {"attention_backend": "triton"},
    "torch": {"attention_backend": "torch"},
    # Two ranks on two GPUs over NCCL, with CUDA graphs: the all-reduce in bf16.
    "flashinfer-tp2": {"attention_backend": "flashinfer", "tp_size": 2},
    # The same with each all-reduce, residual add and norm in one FlashInfer kernel.
    "flashinfer-tp2-fused": {
        "attention_backend": "flashinfer", "tp_size": 2, "enable_flashinfer_allreduce_fusion": True,
    },
}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_bf16_logprobs_match_transformers_on_real_shapes(real_checkpoint, backend):
    if backend.startswith("flashinfer") and not package_imports("flashinfer"):
        pytest.skip("needs flashinfer")
    if BACKENDS[backend].get("tp_size", 1) > torch.cuda.device_count():
        pytest.skip(f"needs {BACKENDS[backend]['tp_size']} GPUs")
    path, prompts, hf, exact = real_checkpoint
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    options = {"dtype": "bfloat16", "device": "cuda", "max_total_tokens": 8192, "cuda_graph_max_bs": 8}
    with RolloutEngine(path, **options, **BACKENDS[backend]) as engine:
        fused = BACKENDS[backend].get("enable_flashinfer_allreduce_fusion", False)
        assert engine.get_server_info()["kernel_plan"]["allreduce_fusion"] == fused
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    ours, theirs, truth = [], [], []
    for ids, out in zip(prompts, outs):
        assert len(out["output_ids"]) == NEW_TOKENS
        ours += [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        theirs.append(_scores(hf, ids, out["output_ids"]))
        truth.append(_scores(exact, ids, out["output_ids"]))
    ours_t = torch.tensor(ours, device="cuda")
    theirs_t, truth_t = torch.cat(theirs), torch.cat(truth)
    stats = {
        "backend": backend,
        "vs_hf_bf16_max": (ours_t - theirs_t).abs().max().item(),
        "vs_fp32": _error_spread(ours_t - truth_t),
        "hf_bf16_vs_fp32": _error_spread(theirs_t - truth_t),
    }
    print(stats)
    # As far from the exact logprobs as transformers' bf16 run, with a quarter to spare, or
    # within the fixed tolerance where that is wider: on the mean and the 90th percentile of
    # the tokens' errors. The worst of 72 tokens is one rounding's luck (two runs with the
    # same spread of errors often differ by more than a quarter in it): it gets twice the
    # bound, enough to catch a token that a wrong row or KV slot puts far off. At tp 2 a
    # row-parallel projection's output is two bf16 partial sums added in bf16: two roundings
    # more per projection than one GPU's (RESULTS.md, fifteenth session: what Qwen3-0.6B's 28
    # layers make of them).
    spare = 1.25 * (TP_SPREAD if BACKENDS[backend].get("tp_size", 1) > 1 else 1.0)
    floor = {"mean": LOGPROB_TOL / 2, "q90": LOGPROB_TOL, "max": LOGPROB_TOL}
    for name, bound in (("mean", spare), ("q90", spare), ("max", 2 * spare)):
        limit = max(floor[name], bound * stats["hf_bf16_vs_fp32"][name])
        assert stats["vs_fp32"][name] <= limit, (name, limit, stats)


def _error_spread(diff: torch.Tensor) -> dict[str, float]:
    err = diff.abs()
    return {"mean": err.mean().item(), "q90": err.quantile(0.9).item(), "max": err.max().item()}
