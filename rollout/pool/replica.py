"""Replica: what the pool needs of one engine, wherever it runs.

Two kinds implement it: a Ray actor around a RolloutEngine (ray_replica.py) and a `rollout
serve` worker over HTTP (http_replica.py). The pool only ever awaits these methods on its own
event loop; each raises the engine's own exceptions for a refused call (ValueError,
WeightSyncError, ...), and `ReplicaDead` when the replica itself is gone (its actor or process
died, its engine stopped, or it cannot be reached), after which the pool restarts it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from rollout.generate_request import GenerateRequest


class ReplicaDead(Exception):
    """The replica is gone (not a refusal of the call): the pool retries elsewhere."""


class Replica:
    """One engine of the pool. `ranks` is its count of ranks in a weight update group (its
    tensor-parallel size), known once `start` has returned."""

    name: str
    ranks: int = 1
    # False: the pool cannot start it again itself (an HTTP worker: its supervisor does); the
    # pool waits until `start` finds it serving again.
    restartable: bool = True

    async def start(self) -> dict:
        """(Re)starts the engine; returns its get_server_info() once it serves."""
        raise NotImplementedError

    async def generate(self, request: GenerateRequest) -> Any:
        """The engine's answer to async_generate(request) (stream=False)."""
        raise NotImplementedError

    def stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        """The engine's stream for async_generate(request) (stream=True); closing it aborts."""
        raise NotImplementedError

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs the engine's method `method` (a RolloutEngine / ControlAPI method name)."""
        raise NotImplementedError

    async def load_tensors(self, named: list[tuple[str, Any]], version: str) -> Any:
        """Loads CPU tensors (name, tensor) as `version`: how a restarted replica gets weights
        that the pool holds. Sent by value (a Ray replica may be on another node)."""
        return await self.call("update_weights_from_tensor", named, weight_version=version)

    async def alive(self) -> bool:
        """False once the replica is gone; never raises."""
        raise NotImplementedError

    async def stop(self) -> None:
        """Shuts the engine down (kills it if it does not answer). Idempotent."""
        raise NotImplementedError
