"""RankWeights: a tensor-parallel rank other than 0, as rank 0's weight calls see it.

Each method is a handler the rank registers under its name in rank_sync.py (`handlers()`), run
between steps when rank 0 asks. The rank keeps no schedule and no version: it loads what rank 0
sends into one open transaction (always with a backup: another rank may still fail), and keeps
it open, across calls while generation is paused, until rank 0 says commit or roll back. A
failure is answered as a ControlError's wire form, never raised: rank 0 decides what it means.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from rollout.config import WeightSyncOptions
from rollout.control import ControlCall
from rollout.errors import ControlError, InvalidRequest, WeightSyncError
from rollout.weight_sync import rank_sync
from rollout.weight_sync.calls import InitWeightsUpdateGroup
from rollout.weight_sync.deferred import Deferred
from rollout.weight_sync.engine_port import EnginePort
from rollout.weight_sync.local_update import LocalUpdates
from rollout.weight_sync.memory import MemoryOccupation
from rollout.weight_sync.transaction import HostBuffers, WeightTransaction
from rollout.weight_sync.update_groups import UpdateGroups

logger = logging.getLogger(__name__)

JOIN_MARGIN_S = 30.0  # past the group's own timeout, a join that has not ended never will
POLL_S = 0.01

Result = dict[str, Any]


class RankWeights:
    def __init__(
        self, engine: EnginePort, options: WeightSyncOptions,
        calls: Mapping[str, type[ControlCall]], rank: int, size: int,
    ) -> None:  # fmt: skip
        """engine: this rank's model and memory regions (it schedules nothing). calls: every
        control call by method name, to rebuild the calls rank 0 sends."""
        self.model = engine.model
        self.opts = options
        self.calls = calls
        self.rank = rank
        self.groups = UpdateGroups(engine.device)
        self.memory = MemoryOccupation(engine, options.enable_weights_cpu_backup)
        released = lambda: "weights" in self.memory.released  # noqa: E731
        self.local = LocalUpdates(engine, self.groups, released, rank, size)
        self.host_buffers = HostBuffers(list(self.model.parameters()))
        self.txn: WeightTransaction | None = None
        self.missing: set[str] = set()  # weights whose values were lost (see the controller)
        self.joins: dict[str, tuple[Deferred, float]] = {}  # group -> (its join, deadline)

    def handlers(self) -> dict[str, Callable[..., Result]]:
        """Every handler by the name rank 0 calls it (rank_sync.HANDLERS)."""
        methods = {
            rank_sync.LOAD: self.load,
            rank_sync.COMMIT: self.commit,
            rank_sync.ROLL_BACK: self.roll_back,
            rank_sync.JOIN: self.join,
            rank_sync.JOINED: self.joined,
            rank_sync.LEAVE: self.leave,
            rank_sync.ROWS: self.rows,
            rank_sync.RELEASE: self.release,
            rank_sync.RESUME: self.resume,
        }
        return {name: self._answering(name, fn) for name, fn in methods.items()}

    def _answering(self, name: str, fn: Callable[..., Result]) -> Callable[..., Result]:
        def run(*args: Any) -> Result:
            try:
                return fn(*args)
            except Exception as e:  # noqa: BLE001 - every failure goes back to rank 0
                if not isinstance(e, (InvalidRequest, WeightSyncError)):
                    logger.exception("tensor-parallel rank %d: %s failed", self.rank, name)
                return {"error": ControlError.of(e, "weight_sync").to_wire()}

        return run

    # ---- updates --------------------------------------------------------------------------------
    def load(self, method: str, wire: dict[str, Any]) -> Result:
        """Loads update `method` (its call's wire form) into the open transaction."""
        call = self.calls[method](**wire)
        if self.txn is None:
            backup = self.opts.weight_update_backup
            no_backup = frozenset(self.missing)
            self.txn = WeightTransaction(self.model, backup, self.host_buffers, no_backup)
        with self.local.open(call) as update:
            for name, tensor in update.tensors():
                self.txn.load(name, tensor, update.presharded)
            self.txn.wait()
        return {}

    def commit(self) -> Result:
        if self.txn is not None:
            self.missing.difference_update(self.txn.commit())
            self.txn = None
        return {}

    def roll_back(self) -> Result:
        if self.txn is None:
            return {"lost": []}
        txn, self.txn = self.txn, None
        lost = txn.unrecoverable()
        txn.rollback()
        self.missing.update(lost)
        return {"lost": lost}

    # ---- update groups ----------------------------------------------------------------------
    def join(self, wire: dict[str, Any]) -> Result:
        """Starts joining as member rank_offset + this rank; `joined` waits for the end."""
        call: InitWeightsUpdateGroup = self.calls[InitWeightsUpdateGroup.method](**wire)
        timeout = call.timeout_s or self.opts.weight_sync_timeout_s
        self._drop_ended_join(call.group_name)
        deferred = self.groups.join(
            call.master_address, call.master_port, call.rank_offset + self.rank, call.world_size,
            call.group_name, call.backend, timeout,
        )  # fmt: skip
        self.joins[call.group_name] = (deferred, time.monotonic() + timeout + JOIN_MARGIN_S)
        return {}

    def joined(self, group_name: str) -> Result:
        if group_name not in self.joins:
            raise WeightSyncError(f"no join of {group_name!r} is under way on this rank")
        deferred, deadline = self.joins.pop(group_name)
        while not deferred.done():
            if time.monotonic() > deadline:
                raise WeightSyncError(f"the join of {group_name!r} did not end")
            time.sleep(POLL_S)
        return deferred.finish()

    def _drop_ended_join(self, group_name: str) -> None:
        """A join rank 0 gave up on before waiting for it (another rank refused to start):
        once it ended, it is forgotten, and left if it succeeded."""
        pending = self.joins.get(group_name)
        if pending is None or not pending[0].done():
            return
        del self.joins[group_name]
        try:
            pending[0].finish()
            self.groups.leave(group_name)
        except Exception:  # noqa: BLE001 - a failed join left nothing behind
            pass

    def leave(self, group_name: str) -> Result:
        return self.groups.leave(group_name)

    # ---- reading and memory -------------------------------------------------------------------
    def rows(self, name: str, rows: int) -> Result:
        """This rank's part of the first `rows` rows of the full tensor `name`, on the host."""
        shard = self.model.hf_shard(name)
        view = rank_sync.rows_of(self.model.hf_weight(name), shard, rows)
        where = None if shard is None else [shard.dim, shard.start, shard.stop, shard.full]
        return {"shard": where, "rows": view.detach().to("cpu", copy=True)}

    def release(self, tags: list[str]) -> Result:
        self.memory.release(tags)
        return {}

    def resume(self, tags: list[str]) -> Result:
        out = self.memory.resume(tags)
        if out["weights_lost"]:
            self.missing = set(self.local.expected)
        return {"weights_lost": out["weights_lost"]}
