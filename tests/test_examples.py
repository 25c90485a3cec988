"""The trainer examples run as users run them (`python trainers_examples/NAME.py ...`, each in a
subprocess): short runs finish with finite numbers, every step logs the metrics they promise,
the weights pushed into the engine are the trainer's (logprob gap at float32 rounding), GRPO
with its defaults learns the toy task, and each run leaves an offline wandb run and a PNG of
its curves in its run directory (and still runs, saying how to install them, without wandb or
matplotlib). PPO's runs are in test_ppo_example.py."""

from __future__ import annotations

import json
import math
import os
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
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_example(
    name: str, *args: str, cwd: str, timeout: float = 240, hide: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`python trainers_examples/NAME ARGS` in cwd; `hide`: modules made unimportable in it, as
    if they were not installed."""
    script = os.path.join(ROOT, "trainers_examples", name)
    command = [sys.executable, script, *args]
    if hide:
        # None in sys.modules makes `import name` raise ImportError; runpy then runs the script
        # as `python script` would (its own directory first on sys.path).
        command = [sys.executable, "-c", (
            "import runpy, sys\n"
            f"sys.modules.update(dict.fromkeys({list(hide)!r}))\n"
            f"sys.argv = {[script, *args]!r}\n"
            f"sys.path.insert(0, {os.path.dirname(script)!r})\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n"
        )]  # fmt: skip
    # One torch thread per process (tests/conftest.py), inherited by the example's processes.
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)  # the examples' own default (offline) is what is tested
    # cwd: a temporary directory, where the default run directory (./runs/...) goes.
    return subprocess.run(
        command,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
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


def assert_plot(proc: subprocess.CompletedProcess, path) -> None:
    """A PNG at path, and the run said where."""
    assert path.is_file(), proc.stdout[-4000:]
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert f"plot of reward and logprob gap per step: {path}" in proc.stdout


def assert_offline_wandb_run(proc: subprocess.CompletedProcess, log_dir) -> None:
    """One offline wandb run under log_dir/wandb holding the steps' metrics and the summary,
    and the run said where it is and how to upload it."""
    runs = list((log_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, (list(log_dir.iterdir()), proc.stdout[-4000:])
    [data] = runs[0].glob("run-*.wandb")
    records = data.read_bytes()
    assert b"logprob_gap" in records and b"final_reward" in records
    assert f"wandb sync {runs[0]}" in proc.stdout


def test_run_log_without_wandb_or_matplotlib_still_logs_and_says_how_to_get_them(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.syspath_prepend(os.path.join(ROOT, "trainers_examples"))
    for name in ("wandb", "matplotlib"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    monkeypatch.chdir(tmp_path)
    from run_log import RunLog

    log = RunLog("demo", {"lr": 0.1})  # default run directory: ./runs/demo-<time>
    for step in (1, 2):
        log.log(step, {"reward": 0.5, "logprob_gap": 1e-7, "weight_sync_s": 0.1,
                       "rollout_tokens_per_s": 100.0})  # fmt: skip
    summary = log.finish()
    out = capsys.readouterr().out
    assert summary["steps"] == 2 and json.loads(out.splitlines()[-1]) == summary
    assert "wandb is not installed" in out and "matplotlib is not installed" in out
    assert "pip install -e '.[examples]'" in out
    [log_dir] = (tmp_path / "runs").glob("demo-*")
    assert log.log_dir == str(log_dir) and list(log_dir.iterdir()) == []


def test_remote_trainer_short_run_starts_a_server_and_updates_it_over_gloo(tmp_path):
    proc = run_example("remote_trainer.py", "--steps", "2", "--no-wandb", cwd=str(tmp_path))
    summary = summary_of(proc, steps=2)
    assert summary["backend"] == "gloo" and summary["weight_version"] == "step-2"
    assert summary["max_logprob_gap"] < FLOAT32_GAP
    assert summary["initial_sync_s"] > 0
    # No --log-dir: ./runs/remote_trainer-<time>; --no-wandb leaves the plot alone.
    [log_dir] = (tmp_path / "runs").glob("remote_trainer-*")
    assert_plot(proc, log_dir / "remote_trainer.png")
    assert not (log_dir / "wandb").exists() and "no wandb run (--no-wandb)" in proc.stdout


def test_remote_trainer_against_a_running_server_with_an_admin_key(tiny_qwen3, tmp_path):
    server, url = start_server(
        tiny_qwen3, "--api-key", "user", "--admin-api-key", "admin", api_key="user"
    )
    try:
        # As if only `pip install -e .` had been run: no wandb, and the example goes on.
        proc = run_example(
            "remote_trainer.py", "--url", url, "--api-key", "admin", "--model-path", tiny_qwen3,
            "--steps", "2", "--per-tensor", "--log-dir", "logs", "--tis-cap", "2",
            cwd=str(tmp_path), hide=("wandb",),
        )  # fmt: skip
        summary = summary_of(proc, steps=2)
        # The trainer's weights went to the server before the first rollout and after each step.
        assert summary["weight_version"] == "step-2" and summary["max_logprob_gap"] < FLOAT32_GAP
        assert summary["max_token_logprob_gap"] < FLOAT32_GAP and summary["mean_ratio_off"] == 0
        assert server.poll() is None  # the example leaves a server it did not start running
        assert "wandb is not installed" in proc.stdout and ".[examples]" in proc.stdout
        assert not (tmp_path / "logs" / "wandb").exists()
        assert_plot(proc, tmp_path / "logs" / "remote_trainer.png")
    finally:
        stop_server(server)


@pytest.mark.slow
def test_grpo_with_its_defaults_learns_the_toy_task_and_logs_the_run(tmp_path):
    """With the README's install (the examples extra), no WANDB_MODE and only --log-dir: the
    engine's rollouts come from the trainer's weights of every step, the policy learns, and an
    offline wandb run and the PNG are in the chosen --log-dir, nothing beside it."""
    proc = run_example("grpo.py", "--log-dir", "logs", cwd=str(tmp_path), timeout=300)
    summary = summary_of(proc, steps=20)
    assert summary["weight_version"] == "step-20"  # each step's push was taken, in order
    assert summary["mean_logprob_gap"] < FLOAT32_GAP and summary["max_logprob_gap"] < FLOAT32_GAP
    assert summary["mean_weight_sync_s"] > 0
    assert summary["first_reward"] < 0.2, summary["rewards"]
    assert summary["final_reward"] > 0.8, summary["rewards"]
    assert_offline_wandb_run(proc, tmp_path / "logs")
    assert_plot(proc, tmp_path / "logs" / "grpo.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs"]


@pytest.mark.slow
def test_grpo_lora_with_its_defaults_learns_the_toy_task(tmp_path):
    """--lora-rank: the engine serves the PEFT policy's adapter, pushed alone each step; its
    rollouts' logprobs are the trainer's (a push that missed or garbled the adapter, or went to
    the base weights, would leave a gap orders above rounding), and the policy learns."""
    pytest.importorskip("peft")
    proc = run_example("grpo.py", "--lora-rank", "8", "--no-wandb", cwd=str(tmp_path), timeout=300)
    summary = summary_of(proc, steps=20)
    assert summary["weight_version"] == "step-20"  # the adapter's version, on every rollout
    assert summary["mean_logprob_gap"] < FLOAT32_GAP and summary["max_logprob_gap"] < FLOAT32_GAP
    assert summary["mean_weight_sync_s"] > 0
    assert summary["first_reward"] < 0.2, summary["rewards"]
    assert summary["final_reward"] > 0.8, summary["rewards"]


@pytest.mark.parametrize("name", ["grpo.py", "remote_trainer.py", "ppo.py"])
def test_help_lists_the_flags_and_bad_flags_are_named(name, tmp_path):
    proc = run_example(name, "--help", cwd=str(tmp_path), timeout=60)
    assert proc.returncode == 0, proc.stderr
    flags = ("--model-path", "--device", "--dtype", "--steps", "--n", "--lr", "--no-wandb")
    for flag in (*flags, "--log-dir"):
        assert flag in proc.stdout
    bad = run_example(name, "--steps", "0", cwd=str(tmp_path), timeout=60)
    assert bad.returncode != 0 and "--steps must be >= 1, got 0" in bad.stderr
