"""The device time of steps, by kind: what a benchmark reads to tell which batch sizes a run's
time went to (get_server_info's device_busy_by_step)."""

from __future__ import annotations

import time

import torch

from rollout.engine.busy_timer import BusyTimer, step_kind


def test_steps_are_named_by_mode_and_decode_batch_bucket():
    assert step_kind(False, 300) == "extend"
    assert [step_kind(True, n) for n in (1, 2, 8, 9, 256, 257, 2048)] == [
        "decode 1-1", "decode 2-8", "decode 2-8", "decode 9-32", "decode 193-256",
        "decode 257-512", "decode 1025-2048",
    ]  # fmt: skip
    assert step_kind(True, 5000) == "decode >2048"


def test_each_kinds_steps_and_seconds_add_up_to_the_total():
    timer = BusyTimer(torch.device("cpu"))
    for kind, pause in (("extend", 0.02), ("decode 2-8", 0.01), ("decode 2-8", 0.01)):
        assert timer.time(lambda p=pause, k=kind: time.sleep(p) or k, kind) == kind
    by_kind = timer.by_kind
    assert list(by_kind) == ["decode 2-8", "extend"]
    assert (by_kind["extend"]["steps"], by_kind["decode 2-8"]["steps"]) == (1, 2)
    assert by_kind["decode 2-8"]["seconds"] >= 0.02 and by_kind["extend"]["seconds"] >= 0.02
    total = sum(entry["seconds"] for entry in by_kind.values())
    assert abs(total - timer.seconds) < 1e-9
    # On the CPU a launch computes its step: the host's time in it is the step's.
    assert all(entry["host_seconds"] == entry["seconds"] for entry in by_kind.values())
