"""The trainer examples run as users run them (`python trainers_examples/NAME.py ...`, each in a
subprocess): short runs finish with finite numbers, every step logs the metrics they promise,
the weights pushed into the engine are the trainer's (logprob gap at float32 rounding), and
GRPO with its defaults learns the toy task."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys

import pytest
from server_helpers import start_server, stop_server

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_METRICS = ("reward", "logprob_gap", "weight_sync_s", "rollout_tokens_per_s")
SUMMARY_KEYS = ("steps", "first_reward", "final_reward", "mean_logprob_gap")
# The engine and the trainer both run float32 on the host: the same weights give logprobs equal
# up to rounding. A push that lost or garbled weights shows up as a gap orders above this.
FLOAT32_GAP = 1e-4


def run_example(name: str, *args: str, cwd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    script = os.path.join(ROOT, "trainers_examples", name)
    # One torch thread per process. An example runs three processes (trainer, scheduler,
    # detokenizer; a server too for remote_trainer.py). With torch's one thread per core each,
    # their small ops wait on descheduled threads whenever the cores are shared: on this 2-core
    # machine, busy with other work, rollouts ran 60x slower (75 vs 5000 tokens/s).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # cwd: a temporary directory, so that a wandb installed here writes its offline run there.
    return subprocess.run(
        [sys.executable, script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def summary_of(proc: subprocess.CompletedProcess, steps: int, exit_code: bool = True) -> dict:
    """The final JSON line, checked; `exit_code=False` leaves the exit status to the caller."""
    if exit_code:
        assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    summary = json.loads(lines[-1])
    for key in SUMMARY_KEYS:
        assert key in summary, f"the summary lacks {key}: {summary}"
    numbers = [v for v in summary.values() if isinstance(v, (int, float))] + summary["rewards"]
    assert all(math.isfinite(v) for v in numbers), summary
    assert summary["steps"] == steps and len(summary["rewards"]) == steps
    step_lines = [line for line in lines if line.startswith("step ")]
    assert len(step_lines) == steps, proc.stdout
    for line in step_lines:
        assert all(f" {metric} " in line for metric in STEP_METRICS), line
    return summary


def test_grpo_short_run_pushes_the_trainers_weights_every_step(tmp_path):
    proc = run_example("grpo.py", "--steps", "2", "--no-wandb", cwd=str(tmp_path))
    summary = summary_of(proc, steps=2)
    assert summary["weight_version"] == "step-2"  # each step's push was taken, in order
    assert summary["mean_logprob_gap"] < FLOAT32_GAP and summary["max_logprob_gap"] < FLOAT32_GAP
    assert 0 <= summary["first_reward"] <= 1 and summary["mean_weight_sync_s"] > 0


def test_remote_trainer_short_run_starts_a_server_and_updates_it_over_gloo(tmp_path):
    proc = run_example("remote_trainer.py", "--steps", "2", "--no-wandb", cwd=str(tmp_path))
    summary = summary_of(proc, steps=2)
    assert summary["backend"] == "gloo" and summary["weight_version"] == "step-2"
    assert summary["max_logprob_gap"] < FLOAT32_GAP
    assert summary["initial_sync_s"] > 0


def test_remote_trainer_against_a_running_server_with_an_admin_key(tiny_qwen3, tmp_path):
    server, url = start_server(tiny_qwen3, "--api-key", "user", "--admin-api-key", "admin", api_key="user")
    try:
        proc = run_example(
            "remote_trainer.py", "--url", url, "--api-key", "admin", "--model-path", tiny_qwen3,
            "--steps", "2", "--per-tensor", "--no-wandb", cwd=str(tmp_path),
        )  # fmt: skip
        summary = summary_of(proc, steps=2, exit_code=False)
        # The trainer's weights went to the server before the first rollout and after each step.
        assert summary["weight_version"] == "step-2" and summary["max_logprob_gap"] < FLOAT32_GAP
        assert server.poll() is None  # the example leaves a server it did not start running
    finally:
        stop_server(server)
    if proc.returncode == -signal.SIGABRT and "terminate called" in proc.stderr:
        # Known bug in rollout/weight_sync/update_group.py: UpdateGroup.close() drops the
        # process group on a daemon thread, and a process that exits right after closing it
        # (the server being still up) aborts in the group's destructor. Everything before the
        # exit worked (checked above).
        pytest.xfail("UpdateGroup.close() then exit aborts (std::terminate) while the peer is up")
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow
def test_grpo_with_its_defaults_learns_the_toy_task(tmp_path):
    proc = run_example("grpo.py", cwd=str(tmp_path), timeout=300)
    summary = summary_of(proc, steps=20)
    assert summary["first_reward"] < 0.2, summary["rewards"]
    assert summary["final_reward"] > 0.8, summary["rewards"]
    assert summary["mean_logprob_gap"] < FLOAT32_GAP


@pytest.mark.parametrize("name", ["grpo.py", "remote_trainer.py"])
def test_help_lists_the_flags_and_bad_flags_are_named(name, tmp_path):
    proc = run_example(name, "--help", cwd=str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--model-path", "--device", "--dtype", "--steps", "--n", "--lr", "--no-wandb"):
        assert flag in proc.stdout
    bad = run_example(name, "--steps", "0", cwd=str(tmp_path), timeout=60)
    assert bad.returncode != 0 and "--steps must be >= 1, got 0" in bad.stderr
