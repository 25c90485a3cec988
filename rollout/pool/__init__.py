"""Scale-out: a pool of engine replicas (Ray actors or `rollout serve` workers) behind the
RolloutEngine API, a prefix-affinity router, and `rollout router`, the HTTP front of a pool."""

from __future__ import annotations

from typing import Any

__all__ = ["PoolOptions", "RolloutPool"]


def __getattr__(name: str) -> Any:
    # Lazy: importing the package must not pull in torch, the engine or Ray.
    if name == "RolloutPool":
        from rollout.pool.pool import RolloutPool

        return RolloutPool
    if name == "PoolOptions":
        from rollout.pool.pool_setup import PoolOptions

        return PoolOptions
    raise AttributeError(f"module 'rollout.pool' has no attribute {name!r}")
