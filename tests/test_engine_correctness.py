"""RolloutEngine against transformers: greedy tokens and logprobs, float32 on CPU."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout import RolloutEngine

NEW_TOKENS = 12


def _prompts(vocab: int, seed: int = 0, count: int = 9) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 90))] for _ in range(count)]


def _hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def arch_setup(request):
    path = request.getfixturevalue(request.param)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size)
    with torch.no_grad():
        expected = [_hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    return path, hf, prompts, expected


@pytest.mark.parametrize(
    "options",
    [{}, {"chunked_prefill_size": 16}, {"disable_radix_cache": True, "chunked_prefill_size": 32}],
    ids=["default", "chunked16", "no-cache"],
)
def test_greedy_batch_equals_transformers(arch_setup, options):
    path, _, prompts, expected = arch_setup
    params = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with RolloutEngine(path, dtype="float32", device="cpu", **options) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        # Again, now with every prompt in the prefix cache (when it is on).
        again = engine.generate(input_ids=prompts, sampling_params=params)
        info = engine.get_server_info()
    assert [o["output_ids"] for o in outs] == expected
    assert [o["output_ids"] for o in again] == expected
    for o in outs:
        assert o["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert o["meta_info"]["completion_tokens"] == NEW_TOKENS
    if options.get("disable_radix_cache"):
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in again)
    else:
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in again)
    assert info["kv_whole"]


def test_logprobs_match_transformers_forward(tiny_qwen3):
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3, torch_dtype=torch.float32).eval()
    prompts = _prompts(hf.config.vocab_size, seed=1, count=3)
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu") as engine:
        outs = engine.generate(
            input_ids=prompts,
            sampling_params={"temperature": 1.0, "max_new_tokens": 8, "seed": 7, "ignore_eos": True},
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=3,
            token_ids_logprob=[5, 6],
        )
    for ids, out in zip(prompts, outs):
        meta = out["meta_info"]
        full = ids + out["output_ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), dim=-1)
        inp = meta["input_token_logprobs"]
        assert len(inp) == len(ids) and inp[0] == (None, ids[0], None)
        for pos in range(1, len(ids)):
            lp, tid, _ = inp[pos]
            assert tid == ids[pos]
            assert abs(lp - ref[pos - 1, tid].item()) <= 1e-4
        outlp = meta["output_token_logprobs"]
        assert [t for _, t, _ in outlp] == out["output_ids"]
        for k, (lp, tid, _) in enumerate(outlp):
            assert abs(lp - ref[len(ids) - 1 + k, tid].item()) <= 1e-4
        for k, top in enumerate(meta["output_top_logprobs"]):
            want = ref[len(ids) - 1 + k].topk(3)
            assert [t for _, t, _ in top] == want.indices.tolist()
            assert max(abs(a[0] - b) for a, b in zip(top, want.values.tolist())) <= 1e-4
        for k, given in enumerate(meta["output_token_ids_logprobs"]):
            assert [t for _, t, _ in given] == [5, 6]
            assert abs(given[0][0] - ref[len(ids) - 1 + k, 5].item()) <= 1e-4


def test_prompt_logprobs_from_start_len_with_cached_prefix(tiny_llama):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32).eval()
    ids = _prompts(hf.config.vocab_size, seed=2, count=1)[0] + [7] * 40
    with RolloutEngine(tiny_llama, dtype="float32", device="cpu", chunked_prefill_size=16) as engine:
        engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})  # caches the prompt
        out = engine.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": 0},
            return_logprob=True,
            logprob_start_len=20,
        )
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    inp = out["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp] == ids[20:]
    for k, (lp, tid, _) in enumerate(inp):
        assert abs(lp - ref[20 + k - 1, tid].item()) <= 1e-4
    assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0
