"""The trainer parity model (rollout.parity): its logprobs equal bit for bit those of an engine
with deterministic inference on the same trajectories, its gradients are torch autograd's on
the HF model, and GRPO trained through it (`grpo.py --parity`) has a logprob gap of exactly 0
at every step (issue 24)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_deterministic_inference import DEVICE, _ids, _req, _run

from rollout.parity import ParityModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_qwen2"])
def test_parity_logprobs_equal_the_engines_bit_for_bit(arch, request):
    # qwen3: per-head q/k norms; qwen2: q/k/v biases and a tied LM head.
    path = request.getfixturevalue(arch)
    reqs = [
        _req("a", _ids(21, 11), 1, start=1, temperature=1.0, max_new_tokens=6),
        _req("b", _ids(22, 3), 3, start=1, temperature=0.0, max_new_tokens=5),
    ]
    engine = _run(path, reqs)
    model = ParityModel.from_pretrained(path, device=DEVICE)
    with torch.no_grad():
        logprobs = model([r.input_ids + engine[r.rid]["ids"] for r in reqs])
    for r, got in zip(reqs, logprobs):
        out = engine[r.rid]
        # Entries (logprob, token id, text): prompt tokens 1.., then the sampled ones.
        want = [e[0] for e in out["input_token_logprobs"] + out["output_token_logprobs"]]
        assert got.tolist() == want, r.rid  # Python floats of float32 values: bitwise


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("arch", ["tiny_qwen3", "tiny_qwen2"])
def test_parity_gradients_match_autograd_on_the_hf_model(arch, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(arch)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE)
    model = ParityModel(hf)  # the HF model's own parameters
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 800, (n,), generator=gen).tolist() for n in (9, 17, 4)]
    weights = [torch.randn(len(s) - 1, generator=gen) for s in seqs]

    weights = [w.to(DEVICE) for w in weights]
    sum((lp * w).sum() for lp, w in zip(model(seqs), weights)).backward()
    ours = _grads(hf)
    for seq, w in zip(seqs, weights):
        ids = torch.tensor([seq], device=DEVICE)
        lp = torch.log_softmax(hf(ids).logits[0].float(), dim=-1)[:-1]
        (lp.gather(1, ids[0, 1:, None])[:, 0] * w).sum().backward()
    reference = _grads(hf)

    assert ours.keys() == reference.keys() and len(ours) == len(list(hf.parameters()))
    for name, want in reference.items():
        scale = max(1.0, want.abs().max().item())  # within 1e-5 of the gradient's size
        torch.testing.assert_close(ours[name], want, rtol=0, atol=1e-5 * scale, msg=name)


def test_padded_batches_score_as_the_sequences_alone(tiny_qwen3):
    model = ParityModel.from_pretrained(tiny_qwen3, device=DEVICE)
    seqs = [_ids(31, 7), _ids(32, 3)]
    ids = torch.zeros(2, 7, dtype=torch.long)
    mask = torch.zeros(2, 7, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)], mask[row, : len(s)] = torch.tensor(s), 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    with torch.no_grad():
        padded = model.padded_token_logprobs(ids, mask)
        alone = [model([s])[0] for s in seqs]
    assert padded.shape == (2, 6)
    assert torch.equal(padded[0], alone[0])
    assert torch.equal(padded[1, :2], alone[1]) and not padded[1, 2:].any()
    with pytest.raises(ValueError, match="right-padded"):
        model.padded_token_logprobs(ids, mask.flip(1))


def test_grpo_parity_example_has_a_logprob_gap_of_zero_at_every_step(tmp_path):
    script = os.path.join(ROOT, "trainers_examples", "grpo.py")
    # A random tiny model's 3-token answers score 0 nearly always, and a group of equal rewards
    # has no gradient: the weight decay is what makes step 1's push carry new weights, so
    # that step 2 samples from and scores with weights the trainer changed.
    args = ["--parity", "--steps", "2", "--prompts-per-step", "1", "--n", "2",
            "--max-new-tokens", "3", "--minibatches", "1", "--weight-decay", "0.1",
            "--no-wandb", "--log-dir", str(tmp_path / "run")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, script, *args], cwd=tmp_path, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2
    # Every token of every step: the largest per-token gap of any step is 0.
    assert summary["max_token_logprob_gap"] == 0.0 and summary["mean_logprob_gap"] == 0.0
