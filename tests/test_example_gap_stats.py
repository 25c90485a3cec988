"""The examples' measure of the engine/trainer gap per token (mean, max, fraction of tokens whose
probability ratio leaves [0.8, 1.25]) and their truncated importance sampling weights, on a batch
whose engine logprobs are the trainer's shifted by known amounts."""

from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainers_examples")


@pytest.fixture(scope="module")
def rollout_batch():
    sys.path.insert(0, EXAMPLES)
    try:
        import rollout_batch

        yield rollout_batch
    finally:
        sys.path.remove(EXAMPLES)


def test_gap_statistics_and_tis_weights_follow_the_shifts(rollout_batch, tiny_qwen3):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    prompt, output = [5, 9, 13], [17, 21, 25, 29]
    batch = rollout_batch.RolloutBatch([prompt], [output], [[0.0] * 4], torch.zeros(1), 1)
    exact = batch.tensors([0], torch.zeros(1), "cpu")
    with torch.no_grad():
        trainer = rollout_batch.token_logprobs(model, exact)[0][exact.mask[0] > 0]
    shifts = torch.tensor([0.0, 0.5, -0.5, 0.1])  # engine = trainer - shift: ratio exp(shift)
    batch.engine_logprobs = [(trainer - shifts).tolist()]

    stats = rollout_batch.logprob_gap(model, batch, micro_batch=4, device="cpu")
    assert stats["logprob_gap"] == pytest.approx(0.275, abs=1e-5)
    assert stats["logprob_gap_max"] == pytest.approx(0.5, abs=1e-5)
    assert stats["ratio_off"] == 0.5  # exp(0.5) > 1.25 and exp(-0.5) < 0.8
    assert batch.trainer_logprobs[0] == pytest.approx(trainer.tolist(), abs=1e-6)

    t = batch.with_tis(batch.tensors([0], torch.ones(1), "cpu"), [0], cap=1.5)
    on = t.mask[0] > 0
    want = [min(math.exp(s), 1.5) for s in shifts.tolist()]
    assert t.tis_weights[0][on].tolist() == pytest.approx(want, abs=1e-5)
    assert t.old_logprobs[0][on].tolist() == pytest.approx(trainer.tolist(), abs=1e-6)
    assert t.tis_weights[0][~on].abs().sum() == 0


def test_tis_without_the_trainer_logprobs_is_a_clear_error(rollout_batch):
    batch = rollout_batch.RolloutBatch([[1, 2]], [[3]], [[-1.0]], torch.zeros(1), 1)
    args = SimpleNamespace(minibatches=1, micro_batch=1, trainer_device="cpu", tis_cap=2.0)
    with pytest.raises(ValueError, match="needs logprob_gap"):
        rollout_batch.optimize(torch.nn.Linear(1, 1), None, batch, None, args)
