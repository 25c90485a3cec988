"""WeightSyncController: every weight-sync control call, run inside the scheduler process.

Control calls run between scheduler steps, so the step loop is held while one runs; joining an
update group, which waits on the trainer, runs on a thread instead and replies when done (see
update_groups.py): calls for that group wait until the join has ended. Every update,
whatever its source, takes one path: check every name, shape and dtype against the model ->
load through the model's `load_weights` inside a WeightTransaction -> commit (publish the new
version; later requests never reuse KV from older weights) or roll back, leaving the previous
weights and version serving.

An update with `lora_name` changes a loaded LoRA adapter instead of the base model's weights
(adapter_update.py): the same checks before any write, its own version label, staged alike.

While generation is paused, updates are staged into one open transaction: they become visible
together at `continue_generation` (or `update_weight_version`), and an update refused or
failed meanwhile, of the base weights or of an adapter, drops all of them. Weights whose values were lost (released without a CPU copy, or a failed update that had
no backup) are "missing": generation waits until they are pushed again.

With tensor parallelism this controller runs on rank 0, and every weight and memory call acts
on every rank (rank_sync.py): an update commits on all ranks or is rolled back on all; the
version, the pause and what is staged are rank 0's alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from rollout.config import WeightSyncOptions
from rollout.control import ControlCall
from rollout.errors import EXCEPTIONS, InvalidRequest, RequestError, WeightSyncError, kind_of
from rollout.weight_sync.adapter_update import AdapterUpdates
from rollout.weight_sync.calls import (
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
    DiscardStagedWeights,
    GetWeightsByName,
    GetWeightVersion,
    InitWeightsUpdateGroup,
    PauseGeneration,
    ReleaseMemoryOccupation,
    ResumeMemoryOccupation,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
    UpdateWeightVersion,
)
from rollout.weight_sync.deferred import Deferred
from rollout.weight_sync.engine_port import EnginePort
from rollout.weight_sync.group_calls import GroupCalls
from rollout.weight_sync.local_update import LocalUpdates, Update
from rollout.weight_sync.memory import MemoryOccupation
from rollout.weight_sync.rank_sync import OtherRanks, OtherRankWeights
from rollout.weight_sync.transaction import HostBuffers, WeightTransaction
from rollout.weight_sync.update_groups import UpdateGroups
from rollout.weight_sync.versions import VersionLabels
from rollout.weight_sync.weight_roots import path_under_roots

logger = logging.getLogger(__name__)

PAUSED, MISSING = "paused", "weights_missing"  # why generation is held

Result = dict[str, Any]


class WeightSyncController:
    def __init__(self, engine: EnginePort, options: WeightSyncOptions) -> None:
        self.engine, self.model = engine, engine.model
        self.opts = options
        self.expected = self.model.hf_param_shapes()
        self.versions = VersionLabels(engine.weight_version)
        self.memory = MemoryOccupation(engine, options.enable_weights_cpu_backup)
        self.groups = UpdateGroups(engine.device)
        self.local = LocalUpdates(engine, self.groups, self._weights_released)
        self.adapters = AdapterUpdates(engine, lambda: self.local)
        self.others: OtherRankWeights | None = None  # the other tensor-parallel ranks
        self.group_calls = GroupCalls(
            self.groups, engine.device, options.weight_sync_timeout_s, lambda: self.others
        )
        self.host_buffers = HostBuffers(list(self.model.parameters()))
        self.txn: WeightTransaction | None = None  # staged while paused
        self.txn_version: str | None = None
        self.paused_mode: str | None = None
        self.missing: set[str] = set()
        self._handlers: dict[type[ControlCall], Callable[[Any], Result | Deferred]] = {
            InitWeightsUpdateGroup: self.group_calls.init,
            DestroyWeightsUpdateGroup: self.group_calls.destroy,
            UpdateWeightsFromDistributed: self.update_weights_from_distributed,
            UpdateWeightsFromTensor: self.update_weights_from_tensor,
            UpdateWeightsFromDisk: self.update_weights_from_disk,
            GetWeightsByName: self.get_weights_by_name,
            GetWeightVersion: lambda _: {"weight_version": self.versions.current},
            UpdateWeightVersion: self.update_weight_version,
            PauseGeneration: self.pause_generation,
            ContinueGeneration: self.continue_generation,
            DiscardStagedWeights: self.discard_staged_weights,
            ReleaseMemoryOccupation: self.release_memory_occupation,
            ResumeMemoryOccupation: self.resume_memory_occupation,
        }

    def use_other_ranks(self, ranks: OtherRanks) -> None:
        """With tensor parallelism (rank 0 runs this controller): every weight and memory call
        acts on `ranks` too, and every update commits on all ranks or on none."""
        self.others = OtherRankWeights(ranks)
        self.local = LocalUpdates(self.engine, self.groups, self._weights_released, 0, ranks.size)
        self.adapters.use_other_ranks(ranks)

    def _weights_released(self) -> bool:
        return "weights" in self.memory.released

    def run(self, call: ControlCall) -> Result | Deferred:
        """Runs one weight call: {"success": True, "message": ..., ...}, or a Deferred of that.
        Raises a RequestError for the caller's mistakes, WeightSyncError for anything else."""
        handler = self._handlers[type(call)]
        return _reported(call.method, lambda: handler(call))

    def info(self) -> dict[str, Any]:
        return {
            "generation_paused": self.paused_mode,
            "weights_missing": len(self.missing),
            "weight_update_staged": len(self.txn.loaded) if self.txn else 0,
            **self.adapters.info(),
            **self.groups.info(),
            **self.memory.info(),
        }

    # ---- the three sources ------------------------------------------------------------------
    def update_weights_from_distributed(
        self, call: UpdateWeightsFromDistributed
    ) -> Result | Deferred:
        retry = lambda: self.update_weights_from_distributed(call)  # noqa: E731
        waiting = self.groups.after_join(call.group_name, retry)
        if waiting is not None:
            return waiting
        self._abort_if_asked(call)
        if call.lora_name is not None:
            return self._adapter_update(call)
        with self._all_or_nothing(call):
            return self._update(self.local.distributed(call), call.weight_version)

    def update_weights_from_tensor(self, call: UpdateWeightsFromTensor) -> Result:
        self._abort_if_asked(call)
        if call.lora_name is not None:
            return self._adapter_update(call)
        with self._all_or_nothing(call), self.local.tensor(call) as update:
            return self._update(update, call.weight_version)

    def update_weights_from_disk(self, call: UpdateWeightsFromDisk) -> Result:
        """model_path and every file opened under it must resolve under one of
        call.allowed_roots (None: anywhere)."""
        self._abort_if_asked(call)
        if call.lora_name is not None:
            return self._adapter_update(call, _check_path)
        with self._all_or_nothing(call):
            _check_path(call)
            return self._update(self.local.disk(call), call.weight_version)

    def _adapter_update(self, call: Any, check: Callable[[Any], None] = lambda _: None) -> Result:
        """An update of a loaded adapter; one refused or failed while paused drops every update
        staged since the pause, as a base-weight one does."""
        try:
            check(call)
            return self.adapters.update(call, PAUSED in self.engine.held_by())
        except Exception as e:
            if self.txn is None and not self.adapters.staged:
                raise
            raise _failure(e, self._roll_back(self.txn, e)) from e

    def _abort_if_asked(self, call: Any) -> None:
        """SGLang's abort_all_requests: the requests in flight end (as aborted) before the
        update. Without it they go on, and their outputs say where the version changed.
        flush_cache is not consulted: KV from older weights is never reused either way."""
        if call.abort_all_requests:
            self.engine.abort_all()

    # ---- the one update path ----------------------------------------------------------------
    @contextlib.contextmanager
    def _all_or_nothing(self, call: ControlCall) -> Iterator[None]:
        """The other ranks (if any) get `call` first and load it alongside rank 0. An update
        that fails in any way (a refused argument too) on any rank while others are staged
        takes them down with it: a paused multi-part update applies whole or not at all."""
        if self.others is not None:
            self.others.start_load(call)
        try:
            yield
        except Exception as e:
            if self.txn is None and not self.adapters.staged and (self.others is None or not self.others.open):
                raise  # nothing staged, or `_update` already rolled it back
            raise _failure(e, self._roll_back(self.txn, e)) from e
        finally:
            if self.others is not None:
                self.others.settle()

    def _update(self, update: Update, version: str | None) -> Result:
        """Loads the (checked) `update`. A streamed one may fail midway, so it is loaded with a
        backup; the others hold every tensor before the first write. While paused the update
        joins the staged transaction instead of committing. With other ranks, nothing commits
        until every rank has loaded, so every rank keeps a backup."""
        staged = PAUSED in self.engine.held_by()
        txn = self.txn
        if txn is None:
            keep = update.streamed or staged or self.others is not None
            backup = self.opts.weight_update_backup if keep else None
            txn = WeightTransaction(self.model, backup, self.host_buffers, frozenset(self.missing))
        try:
            for name, tensor in update.tensors():
                txn.load(name, tensor, update.presharded)
            txn.wait()
            if self.others is not None:
                self.others.check_loaded()
        except Exception as e:
            raise _failure(e, self._roll_back(txn, e)) from e
        if staged:
            self.txn, self.txn_version = txn, version or self.txn_version
            message = f"staged {update.count} tensors; they apply at continue_generation"
            return {"message": message, "staged": True}
        return self._commit(txn, version)

    def _commit(self, txn: WeightTransaction, version: str | None) -> Result:
        if self.others is not None and self.others.open:
            self.others.commit()
        names = txn.commit()
        self.txn, self.txn_version = None, None
        self.missing.difference_update(names)
        if not self.missing:
            self.engine.release_hold(MISSING)
        label = self.versions.publish(version)
        self.engine.publish_weight_version(label, weights_changed=True)
        return {"message": f"loaded {len(names)} weights", "weight_version": label}

    def _roll_back(self, txn: WeightTransaction | None, error: Exception) -> str:
        """Rolls back `txn` and drops every staged adapter update: what the failure left."""
        staged = self.txn is not None or bool(self.adapters.staged)
        if self.adapters.staged:
            self.adapters.discard()
        self.txn, self.txn_version = None, None
        lost = []
        if txn is not None:
            lost = txn.unrecoverable()
            txn.rollback()
        scope = "every update staged since the pause was" if staged else "the update was"
        where = ""
        if self.others is not None and self.others.open:
            lost = sorted({*lost, *self.others.roll_back()})
            where = " on every rank"
        if not lost:
            current = self.versions.current
            return (
                f"{error}; {scope} rolled back{where}: the weights and version {current!r} are "
                "unchanged"
            )
        self.missing.update(lost)
        self.engine.hold(MISSING)
        return (
            f"{error}; {len(lost)} weights were overwritten with no backup to restore, e.g. "
            f"{lost[:3]}: generation waits until they are pushed again"
        )

    # ---- reading and versions ---------------------------------------------------------------
    def get_weights_by_name(self, call: GetWeightsByName) -> Result:
        if "weights" in self.memory.released:
            raise InvalidRequest("the weights are released; call resume_memory_occupation first")
        try:
            view = self.model.hf_weight(call.name)
        except KeyError:
            raise InvalidRequest(f"unknown weight name {call.name!r}") from None
        shard = None if self.others is None else self.model.hf_shard(call.name)
        if shard is None:  # this rank holds all of it
            return {"values": view[: call.truncate_size].float().cpu().tolist()}
        full = self.expected[call.name][0]
        rows = self.others.gather_rows(call.name, view, shard, full, call.truncate_size)
        return {"values": rows.float().tolist()}

    def update_weight_version(self, call: UpdateWeightVersion) -> Result:
        """Publishes call.new_version: staged updates commit under it; otherwise a relabel."""
        if call.abort_all_requests:
            self.engine.abort_all()
        adapters = self.adapters.commit()
        if self.txn is not None:
            return {**self._commit(self.txn, call.new_version), **adapters}
        label = self.versions.publish(call.new_version)
        self.engine.publish_weight_version(label, weights_changed=False)
        return {"weight_version": label, **adapters}

    # ---- pausing and memory -----------------------------------------------------------------
    def pause_generation(self, call: PauseGeneration) -> Result:
        affected = self.engine.count_requests()
        if call.mode == "abort":
            self.engine.abort_all()
        elif call.mode == "retract":
            affected = self.engine.retract_all()
        self.engine.hold(PAUSED)
        self.paused_mode = call.mode
        return {"message": f"paused ({call.mode}); {affected} requests affected"}

    def continue_generation(self, call: ContinueGeneration) -> Result:
        out = self._commit(self.txn, self.txn_version) if self.txn is not None else {}
        out.update(self.adapters.commit())
        self.engine.release_hold(PAUSED)
        self.paused_mode = None
        waiting = self.engine.held_by()
        note = f"; still held: {', '.join(waiting)}" if waiting else ""
        return {**out, "message": f"generation continues{note}"}

    def discard_staged_weights(self, call: DiscardStagedWeights) -> Result:
        adapters = self.adapters.discard()
        if self.txn is None:
            message = f"dropped {adapters} staged LoRA adapter updates" if adapters else ""
            return {"message": message or "no update is staged", "discarded": adapters}
        staged = len(self.txn.loaded) + adapters
        message = self._roll_back(self.txn, RuntimeError("discarded"))
        return {"message": message.removeprefix("discarded; "), "discarded": staged}

    def release_memory_occupation(self, call: ReleaseMemoryOccupation) -> Result:
        if self.txn is not None:
            raise InvalidRequest(
                "an update is staged; continue_generation (or update_weight_version) first"
            )
        out = self.memory.release(list(call.tags))
        if self.others is not None:
            self.others.release(list(call.tags))
        return out

    def resume_memory_occupation(self, call: ResumeMemoryOccupation) -> Result:
        out = self.memory.resume(list(call.tags))
        if self.others is not None and self.others.resume(list(call.tags)):
            out["weights_lost"] = True
        if out["weights_lost"]:
            self.missing = set(self.expected)
            self.engine.hold(MISSING)
        return out


def _check_path(call: UpdateWeightsFromDisk) -> None:
    if call.allowed_roots is not None:
        path_under_roots(call.model_path, call.allowed_roots, "model_path")


def _failure(error: Exception, message: str) -> Exception:
    """What a failed update raises, `message` saying what was rolled back: the caller's mistake
    stays one (InvalidRequest, Forbidden); anything else is a failed transfer."""
    return EXCEPTIONS[kind_of(error, "weight_sync")](message)


def _reported(method: str, run: Callable[[], Result | Deferred]) -> Result | Deferred:
    """Runs a call: its result with success, or a Deferred of it; a failure that is neither the
    caller's mistake nor a failed transfer (a bug) is logged and raised as WeightSyncError."""
    try:
        out = run()
    except RequestError:
        raise
    except WeightSyncError as e:
        logger.warning("%s failed: %s", method, e)
        raise
    except Exception as e:  # noqa: BLE001 - every failure must reach the caller
        logger.exception("%s failed", method)
        raise WeightSyncError(f"{type(e).__name__}: {e}") from e
    if isinstance(out, Deferred):
        return Deferred(out.done, lambda: _reported(method, out.finish))
    return {"success": True, "message": "", **out}
