"""What the engine's counters say happened during a timed run: get_server_info before and after
it, made into the run's own numbers (bench_offline.py, bench_lora.py)."""

from __future__ import annotations


def compiled_between(before: dict, after: dict) -> dict[str, int]:
    """Triton kernel variants compiled between two get_server_info answers, by kernel."""
    was = before.get("kernel_compiles_by_kernel", {})
    now = after.get("kernel_compiles_by_kernel", {})
    return {name: n - was.get(name, 0) for name, n in now.items() if n > was.get(name, 0)}


def step_times(before: dict, after: dict) -> dict:
    """The timed run's steps by kind (extend, decode by batch-size bucket): how many, and the
    device's milliseconds a step, from get_server_info's device_busy_by_step before and after;
    host_ms, the host's milliseconds queueing one (near device_ms: the device waited for it)."""
    out = {}
    for kind, now in after.items():
        was = before.get(kind, {"steps": 0, "seconds": 0.0, "host_seconds": 0.0})
        steps = now["steps"] - was["steps"]
        if steps:
            ms = 1000 * (now["seconds"] - was["seconds"]) / steps
            host = 1000 * (now["host_seconds"] - was["host_seconds"]) / steps
            out[kind] = {"steps": steps, "device_ms": round(ms, 3), "host_ms": round(host, 3)}
    return out


def collector_seconds_between(before: dict, after: dict) -> list[float]:
    """The scheduler process's seconds in Python's collections between two get_server_info
    answers, by generation (zeros from an engine that does not count them)."""
    was, now = (i.get("gc_seconds_by_generation", [0.0] * 3) for i in (before, after))
    return [round(b - a, 3) for a, b in zip(was, now)]
