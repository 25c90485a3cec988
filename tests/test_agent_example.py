"""trainers_examples/agent_grpo.py runs as users run it: each episode is an engine session, the
trainer's loss covers the policy's tokens of both turns (the masked trajectory lines up with
the engine's logprobs: gap at float32 rounding), and with its defaults the policy learns to
call the tool, read its answer and answer with it."""

from __future__ import annotations

import pytest
from test_examples import FLOAT32_GAP, run_example, summary_of

DEFAULT_STEPS = 30  # agent_grpo.py's


@pytest.mark.slow
def test_agent_grpo_with_its_defaults_learns_to_call_read_and_answer(tmp_path):
    proc = run_example("agent_grpo.py", "--no-wandb", cwd=str(tmp_path), timeout=600)
    summary = summary_of(proc, steps=DEFAULT_STEPS)
    assert summary["weight_version"] == f"step-{DEFAULT_STEPS}"
    # Masks or logprobs off by one token would put the gap orders above float32 rounding.
    assert summary["max_logprob_gap"] < FLOAT32_GAP
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert all(" call_rate " in line and " right_rate " in line for line in steps)
    assert summary["first_reward"] < 0.2, summary["rewards"]
    assert summary["final_reward"] > 0.8, summary["rewards"]
    assert summary["call_rate"] > 0.9 and summary["right_rate"] > 0.7, summary
    assert summary["mean_logprob_gap"] < FLOAT32_GAP
