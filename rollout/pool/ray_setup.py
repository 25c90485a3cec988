"""Placing a pool's replicas on a Ray cluster.

One placement group for the pool, one bundle per replica: a bundle lives on one node, so each
replica's CPUs and GPUs (its tensor-parallel ranks) are on one node, and the group's strategy
(SPREAD by default: replicas on different nodes where it can) places the bundles. A restarted
replica goes back to its own bundle, whose resources its dead actor gave back.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from rollout.pool.ray_replica import RayReplica

PLACEMENT_TIMEOUT_S = 300.0


def connect(address: str | None, init_kwargs: dict[str, Any] | None) -> bool:
    """Joins the Ray cluster at `address` ("auto": the one this node belongs to), or starts a
    local one (address None) unless Ray is already initialized. Returns whether this call
    initialized Ray (and the pool must shut it down)."""
    import ray

    if ray.is_initialized():
        return False
    kwargs = {"include_dashboard": False, "log_to_driver": True, **(init_kwargs or {})}
    # ray.init makes SIGTERM exit the process at once; the process's own handlers (the server's
    # graceful shutdown) stay in place.
    kept = _signal_handlers()
    try:
        ray.init(address=address, **kwargs)
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    return True


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}


STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")  # Ray's placement strategies


def check_placement(num_cpus: float, num_gpus: float | None, strategy: str) -> None:
    """ValueError naming what Ray could not place: a negative or empty bundle, a GPU count above
    one that is not whole (Ray shares only fractions of one GPU), an unknown strategy. Checked
    before Ray starts (a negative GPU count waited out the placement timeout)."""
    for name, value in (("num_cpus_per_replica", num_cpus), ("num_gpus_per_replica", num_gpus)):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if value is not None and not (number and value >= 0):  # NaN fails >= 0 too
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if num_gpus is not None and num_gpus > 1 and num_gpus != int(num_gpus):
        raise ValueError(
            f"num_gpus_per_replica above 1 must be a whole number of GPUs, got {num_gpus}"
        )
    if num_cpus == 0 and num_gpus == 0:
        raise ValueError(
            "a replica needs some CPUs or GPUs: num_cpus_per_replica and num_gpus_per_replica "
            "are both 0"
        )
    if strategy not in STRATEGIES:
        raise ValueError(
            f"placement_strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}"
        )


def place_replicas(
    model_path: str, count: int, engine_options: dict[str, Any], num_cpus: float,
    num_gpus: float | None, strategy: str, runtime_env: dict | None,
) -> tuple[Any, list[RayReplica]]:  # fmt: skip
    """The placement group and `count` replicas on it (not started yet). Replica i's engine
    gets random_seed + i: unseeded requests then draw differently on each replica."""
    import ray
    from ray.util.placement_group import placement_group

    if num_gpus is None:
        num_gpus = int(engine_options.get("tp_size", 1)) if _uses_gpu(engine_options) else 0
    bundle = {"CPU": num_cpus, **({"GPU": num_gpus} if num_gpus else {})}
    total = ray.cluster_resources()
    short = {k: v * count for k, v in bundle.items() if v * count > total.get(k, 0)}
    if short:
        raise RuntimeError(
            f"{count} replicas of {bundle} need {short}, the Ray cluster has {total}: use fewer "
            "replicas, or num_gpus_per_replica below 1 to share GPUs"
        )
    group = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(group)
        raise RuntimeError(
            f"the Ray cluster has no room for {count} replicas of {bundle} each "
            f"(strategy {strategy}) within {PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: "
            f"{ray.cluster_resources()}"
        ) from None
    seed = int(engine_options.get("random_seed", 0))
    replicas = [
        RayReplica(
            i,
            model_path,
            {**engine_options, "random_seed": seed + i},
            group,
            num_cpus,
            num_gpus,
            runtime_env,
        )  # fmt: skip
        for i in range(count)
    ]
    return group, replicas


def remove(group: Any, owns_ray: bool) -> None:
    import ray

    if not ray.is_initialized():
        return
    if group is not None:
        try:
            ray.util.remove_placement_group(group)
        except Exception:  # noqa: BLE001 - the cluster may be going away already
            pass
    if owns_ray:
        ray.shutdown()


def _uses_gpu(engine_options: dict[str, Any]) -> bool:
    device = engine_options.get("device")
    if device is not None:
        return str(device).startswith("cuda")
    import ray

    return ray.cluster_resources().get("GPU", 0) > 0  # the engine's default: cuda when there
