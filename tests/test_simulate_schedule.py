"""benchmarks/simulate_schedule.py: the engine's scheduler over a workload with roofline costs,
on the CPU; its estimate by step kind adds up to its total, as bench_offline's "steps" do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "simulate_schedule.py")


def test_the_estimate_by_step_kind_adds_up_to_its_total():
    args = ["--model", "qwen3-0.6b", "--workload", "nano", "--num-seqs", "6", "--kv-tokens", "50000"]
    run = subprocess.run(
        [sys.executable, SCRIPT, *args, "--by-step"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary, by_step = run.stdout.strip().splitlines()[-2:]
    total = float(re.search(r"estimate: ([\d.]+) s", summary).group(1))
    steps = int(re.search(r"; (\d+) steps,", summary).group(1))  # the scheduler's, some empty
    decode = int(re.search(r" (\d+) decode, mean", summary).group(1))
    assert "max_running_requests 256" in summary  # the default for a pool this small
    kinds = json.loads(by_step)
    assert "extend" in kinds and any(k.startswith("decode ") for k in kinds)
    assert sum(v["steps"] for k, v in kinds.items() if k != "extend") == decode
    assert decode < sum(v["steps"] for v in kinds.values()) <= steps
    seconds = sum(v["steps"] * v["device_ms"] for v in kinds.values()) / 1000
    assert abs(seconds - total) < 0.05 + 0.01 * total
