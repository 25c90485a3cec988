"""logit_bias (OpenAI's and SGLang's sampling param): validated, added to the logits before the
draw on every path (greedy, sampled, with penalties and bans), and refused outside the vocabulary."""

from __future__ import annotations

import pytest
import torch
from devices import CPU_AND_CUDA

from rollout.engine.engine import RolloutEngine
from rollout.engine.sampler import SamplingBatch, apply_penalties_and_masks, sample
from rollout.engine.sampling_params import SamplingParams as SP

VOCAB = 50


def _batch(params: list[SP], device: str = "cpu") -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, list(range(n)), [[]] * n, [[1]] * n, [0], VOCAB, device)


def test_keys_are_ids_or_their_strings_and_values_are_bounded():
    assert SP(logit_bias={"7": 2, 9: -1.5}).logit_bias == {7: 2.0, 9: -1.5}
    assert SP(logit_bias={}).logit_bias is None and SP().logit_bias is None
    assert SP.from_dict({"logit_bias": {"3": 100}}).logit_bias == {3: 100.0}
    for bad, message in [
        ({"a": 1}, "logit_bias keys must be token ids >= 0, got 'a'"),
        ({"-1": 1}, "logit_bias keys must be token ids >= 0"),
        ({"1": 100.5}, "logit_bias['1'] must be in [-100, 100], got 100.5"),
        ({"1": "x"}, "logit_bias['1'] must be a number"),
        ([1, 2], "logit_bias must be a dict"),
    ]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
            SP(logit_bias=bad)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_the_bias_is_added_to_its_rows_logits_only(device):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    params = [SP(logit_bias={4: 3.0, 9: -2.0}), SP(), SP(logit_bias={4: -1.0})]
    got = apply_penalties_and_masks(logits.clone(), _batch(params, device))
    want = logits.clone()
    want[0, 4] += 3.0
    want[0, 9] -= 2.0
    want[2, 4] -= 1.0
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_large_bias_decides_greedy_and_sampled_rows(device):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1)).to(device)
    params = [
        SP(temperature=0, logit_bias={11: 100}),
        SP(temperature=1.0, logit_bias={12: 100}),
        SP(temperature=0.7, top_p=0.9, logit_bias={13: 100}),
        SP(temperature=0),
    ]
    tokens = sample(logits.clone(), _batch(params, device))
    assert tokens.tolist()[:3] == [11, 12, 13]
    assert tokens[3].item() == logits[3].argmax().item()


def test_a_bias_never_lifts_a_banned_token():
    # EOS (0) is banned until min_new_tokens: a +100 bias on it must not bring it back.
    params = [SP(temperature=0, min_new_tokens=5, logit_bias={0: 100})]
    logits = torch.zeros(1, VOCAB)
    assert sample(logits, _batch(params)).item() != 0


def test_the_engine_applies_it_and_refuses_ids_outside_the_vocabulary(tiny_qwen3):
    with RolloutEngine(tiny_qwen3, dtype="float32", device="cpu") as engine:
        params = {"temperature": 0, "max_new_tokens": 6, "logit_bias": {"77": 100}}
        out = engine.generate(input_ids=[5, 6, 7], sampling_params=params, return_logprob=True)
        assert out["output_ids"] == [77] * 6
        # The logprobs are the model's own, before the bias.
        assert all(lp < -0.5 for lp, _, _ in out["meta_info"]["output_token_logprobs"])
        vocab = engine.info["vocab_size"]
        bad = {"max_new_tokens": 2, "logit_bias": {str(vocab): 1}}
        with pytest.raises(ValueError, match=rf"logit_bias keys must be ids in \[0, {vocab}\)"):
            engine.generate(input_ids=[5, 6, 7], sampling_params=bad)
