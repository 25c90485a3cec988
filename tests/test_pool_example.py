"""trainers_examples/grpo.py --replicas 2: the same run as with one engine (seeded samples do
not depend on which replica draws them), the pushes reaching both replicas (logprob gap at
float32 rounding)."""

from __future__ import annotations

import json

import pytest
from test_examples import FLOAT32_GAP, run_example

pytest.importorskip("ray")


def _summary(tmp_path, *args: str) -> dict:
    run = run_example("grpo.py", "--steps", "2", "--no-wandb", *args, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_grpo_on_a_pool_of_two_replicas_matches_one_engine(tmp_path):
    pooled = _summary(tmp_path, "--replicas", "2")
    single = _summary(tmp_path)
    assert pooled["rewards"] == single["rewards"]
    assert pooled["weight_version"] == single["weight_version"] == "step-2"
    assert pooled["max_logprob_gap"] < FLOAT32_GAP
