"""UpdateGroups: the named update groups an engine is in, and the joins still under way.

Joining waits on the trainer (up to the group's timeout, 300 s by default), so it runs on a
thread and its reply is deferred: generation goes on meanwhile. Calls for a group that is being
joined (an update, destroy) wait for the join to end, in the order they came. All state here is
touched on the scheduler's thread only: the join thread just fills its future.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from rollout.errors import InvalidRequest
from rollout.weight_sync.deferred import Deferred, in_thread
from rollout.weight_sync.update_group import UpdateGroup


class UpdateGroups:
    def __init__(self, device: torch.device) -> None:
        self.device = device  # the engine's: NCCL groups use it
        self.open: dict[str, UpdateGroup] = {}
        self.joining: dict[str, Future[UpdateGroup]] = {}

    def info(self) -> dict[str, Any]:
        """The groups updates can go through, those being joined, and those closed by a failed
        broadcast (destroy_weights_update_group frees the name to join again)."""
        return {
            "weight_update_groups": sorted(n for n, g in self.open.items() if not g.closed),
            "weight_update_groups_joining": sorted(self.joining),
            "weight_update_groups_closed": sorted(n for n, g in self.open.items() if g.closed),
        }

    def join(
        self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
        backend: str, timeout_s: float,
    ) -> Deferred:  # fmt: skip
        """Starts joining on a thread; the deferred reply comes once every rank joined or the
        join failed (within timeout_s). A failed join leaves nothing behind: retry the name."""
        self.check_free(group_name)
        device = self.device

        def run() -> UpdateGroup:
            # A new thread starts on GPU 0; NCCL sets up its communicator on the current device.
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                return UpdateGroup.join(
                    master_address, master_port, rank, world_size, group_name, backend, timeout_s,
                    device,
                )  # fmt: skip

        future = self.joining[group_name] = in_thread(run, f"join-{group_name}")

        def finish() -> dict:
            del self.joining[group_name]
            self.open[group_name] = future.result()  # raises the join's failure
            return {"message": f"joined {group_name!r} as rank {rank} of {world_size}"}

        return Deferred(future.done, finish)

    def check_free(self, group_name: str) -> None:
        """Raises InvalidRequest unless `group_name` may be joined now."""
        if group_name in self.joining:
            raise InvalidRequest(
                f"weight update group {group_name!r} is being joined; wait for that"
            )
        old = self.open.get(group_name)
        if old is not None and not old.closed:
            raise InvalidRequest(f"weight update group {group_name!r} exists; destroy it first")

    def after_join(self, group_name: str, call: Callable[[], Any]) -> Deferred | None:
        """`call` deferred until the join of `group_name` has ended; None when none is pending
        (run it now). Waiting is what a trainer that sent both calls expects."""
        if group_name not in self.joining:
            return None
        return Deferred(lambda: group_name not in self.joining, call)

    def get(self, group_name: str) -> UpdateGroup:
        group = self.open.get(group_name)
        if group is None or group.closed:
            raise InvalidRequest(
                f"no open weight update group {group_name!r}; call init_weights_update_group"
            )
        return group

    def leave(self, group_name: str) -> dict:
        group = self.open.pop(group_name, None)
        if group is None:
            raise InvalidRequest(
                f"no weight update group {group_name!r}; groups: {sorted(self.open)}"
            )
        group.close()
        return {"message": f"left {group_name!r}"}
