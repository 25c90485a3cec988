"""Per-step metrics for the examples: a line on stdout, a wandb run, a PNG of the curves, a
progress bar over the steps, and one JSON summary line at the end.

The wandb run and the PNG go to the run's directory, --log-dir (default
./runs/NAME-YYYYmmdd-HHMMSS). wandb logs offline unless WANDB_MODE says otherwise (no account
and no network needed; `wandb sync DIR` uploads the run later); without wandb or matplotlib
installed the example runs all the same and says how to get them.

Every step logs at least: reward (mean over the step's samples), logprob_gap (mean |engine -
trainer| logprob over sampled tokens), weight_sync_s (the push) and rollout_tokens_per_s.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from run_plot import write_plot
from tqdm import tqdm

REQUIRED = ("reward", "logprob_gap", "weight_sync_s", "rollout_tokens_per_s")
INSTALL_HINT = "pip install -e '.[examples]' in the repository, or pip install wandb matplotlib"


def default_log_dir(name: str) -> str:
    return os.path.join("runs", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def start_wandb(name: str, config: dict, log_dir: str) -> tuple[Any, str]:
    """(the wandb run or None, a phrase saying where the run logs or why it does not)."""
    try:
        import wandb
    except ImportError:
        return None, f"wandb is not installed, so no wandb run ({INSTALL_HINT})"
    mode = os.environ.get("WANDB_MODE", "offline")
    if mode == "disabled":
        return None, "no wandb run (WANDB_MODE=disabled)"
    try:
        # silent: wandb's own banner would repeat what finish() prints about where the run is.
        run = wandb.init(
            project=f"rollout-{name}",
            name=os.path.basename(log_dir),
            config=config,
            mode=mode,
            dir=log_dir,
            settings=wandb.Settings(silent=True),
        )
    except Exception as e:  # e.g. WANDB_MODE=online without a login: the run goes on without it
        return None, f"wandb.init failed ({type(e).__name__}: {e}), so no wandb run"
    return run, f"wandb run ({run.settings.mode}) in {run.settings.sync_dir}"


class RunLog:
    def __init__(
        self, name: str, config: dict, log_dir: str | None = None, use_wandb: bool = True
    ) -> None:
        self.name = name
        self.history: list[dict[str, float]] = []
        self.started = time.perf_counter()
        self.log_dir = os.path.abspath(log_dir or default_log_dir(name))
        os.makedirs(self.log_dir, exist_ok=True)
        config = {**config, "log_dir": self.log_dir}
        self.wandb_run, where = None, "no wandb run (--no-wandb)"
        if use_wandb:
            self.wandb_run, where = start_wandb(name, config, self.log_dir)
        print(f"[{name}] run directory {self.log_dir}; {where}", flush=True)
        print(f"[{name}] config: {json.dumps(config, sort_keys=True)}", flush=True)

    def steps(self, count: int) -> Iterator[int]:
        """range(count) under a progress bar (see progress)."""
        bar = progress(count, self.name)
        self._bar = bar
        yield from bar

    def log(self, step: int, metrics: dict[str, float]) -> None:
        missing = [k for k in REQUIRED if k not in metrics]
        if missing:
            raise ValueError(f"step metrics must include {', '.join(REQUIRED)}; missing {missing}")
        self.history.append({"step": step, **metrics})
        parts = [f"step {step:3d}"] + [f"{k} {_fmt(v)}" for k, v in metrics.items()]
        line = "  ".join(parts)
        bar = getattr(self, "_bar", None)
        if bar is not None and not bar.disable:
            bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=step)

    def finish(self, **extra: Any) -> dict:
        """Prints the summary as one JSON line (the last line of stdout) and returns it."""
        rewards = [h["reward"] for h in self.history]
        gaps = [h["logprob_gap"] for h in self.history]
        summary = {
            "example": self.name,
            "steps": len(self.history),
            "first_reward": rewards[0] if rewards else math.nan,
            "final_reward": rewards[-1] if rewards else math.nan,
            "mean_logprob_gap": _mean(gaps),
            "max_logprob_gap": max(gaps) if gaps else math.nan,
            # Per token: the largest gap of any step, and the mean fraction of tokens whose
            # probability ratio trainer / engine left [0.8, 1.25].
            "max_token_logprob_gap": max((h.get("logprob_gap_max", 0.0) for h in self.history), default=math.nan),
            "mean_ratio_off": _mean([h.get("ratio_off", 0.0) for h in self.history]),
            "mean_weight_sync_s": _mean([h["weight_sync_s"] for h in self.history]),
            "mean_rollout_tokens_per_s": _mean([h["rollout_tokens_per_s"] for h in self.history]),
            "rewards": [round(r, 4) for r in rewards],
            "total_s": round(time.perf_counter() - self.started, 2),
            **extra,
        }
        self._write_plot()
        if self.wandb_run is not None:
            self._finish_wandb(summary)
        print(json.dumps(summary), flush=True)
        return summary

    def _write_plot(self) -> None:
        if not self.history:
            return
        path = os.path.join(self.log_dir, f"{self.name}.png")
        if write_plot(self.history, path, os.path.basename(self.log_dir)):
            print(f"[{self.name}] plot of reward and logprob gap per step: {path}", flush=True)
        else:
            print(f"[{self.name}] matplotlib is not installed, so no plot ({INSTALL_HINT})")

    def _finish_wandb(self, summary: dict) -> None:
        run = self.wandb_run
        run.summary.update({k: v for k, v in summary.items() if not isinstance(v, list)})
        run.finish()
        if run.offline:
            sync_dir = run.settings.sync_dir
            print(f"[{self.name}] wandb run (offline): {sync_dir}", flush=True)
            print(f"[{self.name}] upload it with: wandb sync {sync_dir}", flush=True)
        else:
            print(f"[{self.name}] wandb run: {run.url or run.settings.sync_dir}", flush=True)


def progress(count: int, desc: str) -> tqdm:
    """range(count) under a progress bar: on stderr, apart from stdout, and only on a terminal."""
    return tqdm(range(count), desc=desc, unit="step", file=sys.stderr, disable=None)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.2e}" if value != 0 and abs(value) < 1e-2 else f"{value:.3f}"
