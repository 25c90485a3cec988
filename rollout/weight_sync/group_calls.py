"""init_weights_update_group and destroy_weights_update_group on every tensor-parallel rank of
an engine: rank 0 joins or leaves beside the other ranks (each as member rank_offset + its rank),
since NCCL's rendezvous and shutdown wait for every rank of a group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollout.errors import InvalidRequest, WeightSyncError
from rollout.weight_sync.calls import DestroyWeightsUpdateGroup, InitWeightsUpdateGroup
from rollout.weight_sync.deferred import Deferred
from rollout.weight_sync.rank_sync import OtherRankWeights
from rollout.weight_sync.update_groups import UpdateGroups

Result = dict[str, Any]


class GroupCalls:
    def __init__(
        self, groups: UpdateGroups, device: torch.device, timeout_s: float,
        others: Callable[[], OtherRankWeights | None],
    ) -> None:  # fmt: skip
        """groups: rank 0's own; timeout_s: a join's when the call names none; others: the
        other tensor-parallel ranks (None without tensor parallelism)."""
        self.groups, self.device, self.timeout_s, self.others = groups, device, timeout_s, others

    def init(self, call: InitWeightsUpdateGroup) -> Deferred:
        if call.backend == "nccl" and self.device.type != "cuda":
            raise InvalidRequest("the nccl backend needs the engine on a GPU; use backend='gloo'")
        others = self.others()
        if others is not None:
            return self._join_on_every_rank(call, others)
        return self.groups.join(
            call.master_address, call.master_port, call.rank_offset, call.world_size,
            call.group_name, call.backend, call.timeout_s or self.timeout_s,
        )  # fmt: skip

    def destroy(self, call: DestroyWeightsUpdateGroup) -> Result | Deferred:
        waiting = self.groups.after_join(call.group_name, lambda: self.destroy(call))
        if waiting is not None:
            return waiting
        others = self.others()
        if others is None:
            return self.groups.leave(call.group_name)
        out, failures = self._leave_on_every_rank(call.group_name, others)
        if failures:
            raise WeightSyncError("; ".join(failures))
        return out

    def _join_on_every_rank(self, call: InitWeightsUpdateGroup, others: OtherRankWeights) -> Deferred:
        """Every rank joins, as member rank_offset + its rank; the reply waits for them all, and
        if any failed, those that joined leave again."""
        name, size = call.group_name, others.size
        if call.rank_offset + size > call.world_size:
            raise InvalidRequest(
                f"world_size {call.world_size} has no room for this engine's {size} "
                f"tensor-parallel ranks, which join as ranks rank_offset ({call.rank_offset}) to "
                f"{call.rank_offset + size - 1}: world_size must count every engine rank"
            )
        self.groups.check_free(name)
        others.join(call)
        here = self.groups.join(
            call.master_address, call.master_port, call.rank_offset, call.world_size, name,
            call.backend, call.timeout_s or self.timeout_s,
        )  # fmt: skip

        def finish() -> Result:
            failures = others.joined(name)
            try:
                here.finish()
            except Exception:
                others.start_leave(name)()  # those that joined; the others have nothing to leave
                raise
            if failures:
                self._leave_on_every_rank(name, others)
                raise WeightSyncError("; ".join(failures))
            last = call.rank_offset + size - 1
            return {
                "message": f"joined {name!r} as ranks {call.rank_offset}-{last} of {call.world_size}"
            }

        return Deferred(here.done, finish)

    def _leave_on_every_rank(self, name: str, others: OtherRankWeights) -> tuple[dict, list[str]]:
        """Rank 0 leaves `name` while the other ranks do (NCCL's shutdown waits for every rank
        of the group); rank 0's reply and the other ranks' failures."""
        try:
            answers = others.start_leave(name)
        except Exception:
            self.groups.leave(name)  # the other ranks can't be asked: rank 0 still leaves
            raise
        try:
            out = self.groups.leave(name)
        finally:
            failures = answers()
        return out, failures
