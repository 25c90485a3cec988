"""trainers_examples/ppo.py as users run it: with its defaults the reward model learns the rule
and the policy learns what the reward model was fitted to, the pushed weights are the
trainer's (logprob gap at float32 rounding), and the reward server it starts never outlives
it, whether the run ends, is stopped (SIGTERM) or is killed (SIGKILL)."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import threading

import pytest
from process_helpers import children, descendants, still_alive
from test_examples import FLOAT32_GAP, ROOT, run_example, summary_of


def reward_server_processes(stderr: str) -> list[int]:
    """The pids of the reward servers ppo.py reported starting."""
    return [int(pid) for pid in re.findall(r"rollout serve \(pid (\d+)\) is ready", stderr)]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_ppo_stopped_mid_training_leaves_no_reward_server_behind(sig, tmp_path):
    """SIGTERM: the trainer unwinds as on an error (exit 143) and stops the server on its way
    out. SIGKILL: the server learns of its parent's death and stops itself. Either way the
    server's scheduler and detokenizer follow it."""
    script = os.path.join(ROOT, "trainers_examples", "ppo.py")
    args = [sys.executable, script, "--rm-steps", "0", "--steps", "100000", "--no-wandb"]
    stderr = tmp_path / "stderr.txt"  # a file: a full pipe nobody reads would stall the run
    with open(stderr, "w") as err:
        trainer = subprocess.Popen(
            args, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=err, text=True
        )
    watchdog = threading.Timer(240, trainer.terminate)  # a trainer that hangs ends the loop below
    watchdog.start()
    try:
        for line in trainer.stdout:
            if line.startswith("step "):
                break
        servers = [pid for pid in children(trainer.pid) if "rollout.serve" in _cmdline(pid)]
        assert len(servers) == 1, f"ppo.py did not start one reward server: {stderr.read_text()}"
        server_children = descendants(servers[0])
        assert len(server_children) >= 2  # the server's scheduler and detokenizer
        trainer.send_signal(sig)
        trainer.wait(60)
    finally:
        watchdog.cancel()
        if trainer.poll() is None:
            trainer.terminate()
            trainer.wait(60)
    if sig == signal.SIGTERM:
        assert trainer.returncode == 128 + signal.SIGTERM, stderr.read_text()[-4000:]
    assert still_alive(servers + server_children, within_s=30) == []


def _cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ")


@pytest.mark.slow
def test_ppo_with_its_defaults_learns_what_the_reward_model_was_fitted_to_and_stops_it(tmp_path):
    proc = run_example("ppo.py", "--no-wandb", cwd=str(tmp_path), timeout=300)
    summary = summary_of(proc, steps=20)
    assert summary["weight_version"] == "step-20" and summary["max_logprob_gap"] < FLOAT32_GAP
    steps = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert all(" rule_reward " in line and " kl " in line for line in steps)
    # The reward model learned the rule before the policy trains.
    assert summary["rm_fit_corr"] > 0.9 and math.isfinite(summary["rm_fit_mse"])
    assert summary["first_reward"] < 0.2 and summary["final_reward"] > 0.6, summary["rewards"]
    # What the reward model taught is what the rule wanted.
    rule_rewards = summary["rule_rewards"]
    assert summary["first_rule_reward"] < 0.2 and summary["final_rule_reward"] > 0.8, rule_rewards
    assert summary["reward_rule_corr"] > 0.8
    # The reward server ppo.py started is gone with it.
    [server] = reward_server_processes(proc.stderr)
    assert still_alive([server], within_s=5) == []
