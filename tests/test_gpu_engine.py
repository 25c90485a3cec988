"""The engine on a CUDA GPU: same greedy tokens and logprobs as transformers on the same GPU."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout import RolloutEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_greedy_and_logprobs_on_gpu_equal_transformers(fixture, request):
    path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf.config.vocab_size) for _ in range(rng.randint(3, 80))] for _ in range(8)]
    with torch.no_grad():
        expected = []
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                max_new_tokens=10,
                min_new_tokens=10,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            expected.append(out[0, len(ids) :].tolist())
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with RolloutEngine(path, dtype="float32", device="cuda", chunked_prefill_size=32) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert engine.get_server_info()["device"].startswith("cuda")
    assert [o["output_ids"] for o in outs] == expected
    for ids, out in zip(prompts, outs):
        full = torch.tensor([ids + out["output_ids"]], device="cuda")
        with torch.no_grad():
            ref = torch.log_softmax(hf(full).logits[0].float(), dim=-1)
        for k, (lp, tid, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
            assert abs(lp - ref[len(ids) - 1 + k, tid].item()) <= 1e-3
