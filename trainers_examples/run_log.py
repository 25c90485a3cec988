"""Per-step metrics for the examples: a line on stdout, wandb (offline unless WANDB_MODE says
otherwise, never an account), a progress bar over the steps, and one JSON summary line at the end.

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

from tqdm import tqdm

REQUIRED = ("reward", "logprob_gap", "weight_sync_s", "rollout_tokens_per_s")


def _start_wandb(name: str, config: dict) -> Any:
    try:
        import wandb
    except ImportError:
        return None
    # Offline by default: runs land in ./wandb and `wandb sync` uploads them if one wants.
    mode = os.environ.get("WANDB_MODE", "offline")
    return wandb.init(project=f"rollout-{name}", config=config, mode=mode)


class RunLog:
    def __init__(self, name: str, config: dict, use_wandb: bool = True) -> None:
        self.name = name
        self.history: list[dict[str, float]] = []
        self.started = time.perf_counter()
        self.wandb_run = _start_wandb(name, config) if use_wandb else None
        where = "wandb offline" if self.wandb_run is not None else "stdout only"
        print(
            f"[{name}] logging to {where}; config: {json.dumps(config, sort_keys=True)}", flush=True
        )

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
            "mean_weight_sync_s": _mean([h["weight_sync_s"] for h in self.history]),
            "mean_rollout_tokens_per_s": _mean([h["rollout_tokens_per_s"] for h in self.history]),
            "rewards": [round(r, 4) for r in rewards],
            "total_s": round(time.perf_counter() - self.started, 2),
            **extra,
        }
        if self.wandb_run is not None:
            self.wandb_run.summary.update({k: v for k, v in summary.items() if k != "rewards"})
            self.wandb_run.finish()
        print(json.dumps(summary), flush=True)
        return summary


def progress(count: int, desc: str) -> tqdm:
    """range(count) under a progress bar: on stderr, apart from stdout, and only on a terminal."""
    return tqdm(range(count), desc=desc, unit="step", file=sys.stderr, disable=None)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return f"{value:.2e}" if value != 0 and abs(value) < 1e-2 else f"{value:.3f}"
