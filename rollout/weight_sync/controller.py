"""WeightSyncController: every weight-sync control call, run inside the scheduler process.

Control calls run between scheduler steps, so the step loop is held while one runs; joining an
update group, which waits on the trainer, runs on a thread instead and replies when done (see
update_groups.py): calls for that group wait until the join has ended. Every update,
whatever its source, takes one path: check every name, shape and dtype against the model ->
load through the model's `load_weights` inside a WeightTransaction -> commit (publish the new
version; later requests never reuse KV from older weights) or roll back, leaving the previous
weights and version serving.

While generation is paused, updates are staged into one open transaction: they become visible
together at `continue_generation` (or `update_weight_version`), and a failure rolls all of them
back. Weights whose values were lost (released without a CPU copy, or a failed update that had
no backup) are "missing": generation waits until they are pushed again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from rollout.config import WeightSyncOptions
from rollout.control import ControlCall
from rollout.errors import (
    EXCEPTIONS,
    Forbidden,
    InvalidRequest,
    RequestError,
    WeightSyncError,
    kind_of,
)
from rollout.models.loader import OutsideRootsError
from rollout.weight_sync import disk_source, distributed_source
from rollout.weight_sync.calls import (
    ContinueGeneration,
    DestroyWeightsUpdateGroup,
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
from rollout.weight_sync.memory import MemoryOccupation
from rollout.weight_sync.specs import WeightSpec, check_against_model
from rollout.weight_sync.tensor_handles import OpenedTensors, check_receivable, open_tensors
from rollout.weight_sync.transaction import HostBuffers, WeightTransaction
from rollout.weight_sync.update_groups import UpdateGroups
from rollout.weight_sync.versions import VersionLabels

logger = logging.getLogger(__name__)

PAUSED, MISSING = "paused", "weights_missing"  # why generation is held
TP_RANK = 0  # one scheduler process per engine for now

Result = dict[str, Any]


class WeightSyncController:
    def __init__(self, engine: EnginePort, options: WeightSyncOptions) -> None:
        self.engine, self.model = engine, engine.model
        self.opts = options
        self.expected = self.model.hf_param_shapes()
        self.versions = VersionLabels(engine.weight_version)
        self.memory = MemoryOccupation(engine, options.enable_weights_cpu_backup)
        self.groups = UpdateGroups(engine.device)
        self.host_buffers = HostBuffers()
        self.txn: WeightTransaction | None = None  # staged while paused
        self.txn_version: str | None = None
        self.paused_mode: str | None = None
        self.missing: set[str] = set()
        self._ipc_open: OpenedTensors | None = None
        self._handlers: dict[type[ControlCall], Callable[[Any], Result | Deferred]] = {
            InitWeightsUpdateGroup: self.init_weights_update_group,
            DestroyWeightsUpdateGroup: self.destroy_weights_update_group,
            UpdateWeightsFromDistributed: self.update_weights_from_distributed,
            UpdateWeightsFromTensor: self.update_weights_from_tensor,
            UpdateWeightsFromDisk: self.update_weights_from_disk,
            GetWeightsByName: self.get_weights_by_name,
            GetWeightVersion: lambda _: {"weight_version": self.versions.current},
            UpdateWeightVersion: self.update_weight_version,
            PauseGeneration: self.pause_generation,
            ContinueGeneration: self.continue_generation,
            ReleaseMemoryOccupation: self.release_memory_occupation,
            ResumeMemoryOccupation: self.resume_memory_occupation,
        }

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
            **self.groups.info(),
            **self.memory.info(),
        }

    # ---- update groups ----------------------------------------------------------------------
    def init_weights_update_group(self, call: InitWeightsUpdateGroup) -> Deferred:
        if call.backend == "nccl" and self.engine.device.type != "cuda":
            raise InvalidRequest("the nccl backend needs the engine on a GPU; use backend='gloo'")
        return self.groups.join(
            call.master_address, call.master_port, call.rank_offset + TP_RANK, call.world_size,
            call.group_name, call.backend, call.timeout_s or self.opts.weight_sync_timeout_s,
        )  # fmt: skip

    def destroy_weights_update_group(self, call: DestroyWeightsUpdateGroup) -> Result | Deferred:
        retry = lambda: self.destroy_weights_update_group(call)  # noqa: E731
        return self.groups.after_join(call.group_name, retry) or self.groups.leave(call.group_name)

    # ---- the three sources ------------------------------------------------------------------
    def update_weights_from_distributed(
        self, call: UpdateWeightsFromDistributed
    ) -> Result | Deferred:
        retry = lambda: self.update_weights_from_distributed(call)  # noqa: E731
        waiting = self.groups.after_join(call.group_name, retry)
        if waiting is not None:
            return waiting
        with self._all_or_nothing():
            group = self.groups.get(call.group_name)
            specs = call.specs
            units = distributed_source.broadcast_units(specs, call.load_format)
            try:
                self._check(specs, exact_dtype=True)
            except RequestError:
                distributed_source.drain(group, units)  # the trainer is sending: let it finish
                raise
            stream = lambda: distributed_source.receive(group, units)  # noqa: E731
            return self._update(specs, stream, True, streamed=True, version=call.weight_version)

    def update_weights_from_tensor(self, call: UpdateWeightsFromTensor) -> Result:
        with self._all_or_nothing():
            handles = call.tensor_handles
            check_receivable(handles)
            opened: list[OpenedTensors] = []

            def source() -> Iterable:
                opened.append(open_tensors(handles))
                return opened[0].named

            try:
                return self._update(handles.specs, source, True, False, call.weight_version)
            finally:
                if opened and handles.kind == "cuda":
                    # CUDA handles stay open until the next call (opened before the previous
                    # ones close): a sender reusing its buffers then hits torch's cache of
                    # open handles.
                    previous, self._ipc_open = self._ipc_open, opened[0]
                    if previous is not None:
                        previous.close()
                elif opened:
                    opened[0].close()

    def update_weights_from_disk(self, call: UpdateWeightsFromDisk) -> Result:
        """Every file opened must resolve under one of call.allowed_roots (None: anywhere)."""
        with self._all_or_nothing():
            path, roots = call.model_path, call.allowed_roots
            with _checkpoint_errors():
                disk_source.check_config(path, self.engine.hf_config, roots)
                found = disk_source.read_specs(path, roots)
            specs = [spec for _, spec in found.values()]
            keep = self._check(specs, exact_dtype=False)
            lacking = sorted(set(self.expected) - {s.name for s in keep})
            if lacking:
                raise InvalidRequest(
                    f"checkpoint {path!r} lacks {len(lacking)} weights, e.g. {lacking[:3]}"
                )
            names = [s.name for s in specs]

            def read() -> list:
                with _checkpoint_errors():
                    return disk_source.read_tensors(found, names, path, roots)

            return self._update(specs, read, False, streamed=False, version=call.weight_version)

    # ---- the one update path ----------------------------------------------------------------
    @contextlib.contextmanager
    def _all_or_nothing(self) -> Iterator[None]:
        """An update that fails in any way (a refused argument too) while others are staged
        takes them down with it: a paused multi-part update applies whole or not at all."""
        try:
            yield
        except Exception as e:
            if self.txn is None:
                raise  # nothing staged, or `_update` already rolled it back
            raise _failure(e, self._roll_back(self.txn, e)) from e

    def _check(self, specs: list[WeightSpec], exact_dtype: bool) -> list[WeightSpec]:
        if "weights" in self.memory.released:
            raise InvalidRequest("the weights are released; call resume_memory_occupation first")
        return check_against_model(specs, self.expected, self.model.is_ignored_weight, exact_dtype)

    def _update(
        self, specs: list[WeightSpec], source: Callable[[], Iterable], exact_dtype: bool,
        streamed: bool, version: str | None,
    ) -> Result:  # fmt: skip
        """Validates `specs`, then loads what `source()` yields. A `streamed` source may fail
        midway, so it is loaded with a backup; the others hold every tensor before the first
        write. While paused the update joins the staged transaction instead of committing."""
        self._check(specs, exact_dtype)
        staged = PAUSED in self.engine.held_by()
        txn = self.txn
        if txn is None:
            backup = self.opts.weight_update_backup if streamed or staged else None
            txn = WeightTransaction(self.model, backup, self.host_buffers, frozenset(self.missing))
        try:
            for name, tensor in source():
                txn.load(name, tensor)
            txn.wait()
        except Exception as e:
            raise _failure(e, self._roll_back(txn, e)) from e
        if staged:
            self.txn, self.txn_version = txn, version or self.txn_version
            message = f"staged {len(specs)} tensors; they apply at continue_generation"
            return {"message": message, "staged": True}
        return self._commit(txn, version)

    def _commit(self, txn: WeightTransaction, version: str | None) -> Result:
        names = txn.commit()
        self.txn, self.txn_version = None, None
        self.missing.difference_update(names)
        if not self.missing:
            self.engine.release_hold(MISSING)
        label = self.versions.publish(version)
        self.engine.publish_weight_version(label, weights_changed=True)
        return {"message": f"loaded {len(names)} weights", "weight_version": label}

    def _roll_back(self, txn: WeightTransaction, error: Exception) -> str:
        staged = self.txn is not None
        self.txn, self.txn_version = None, None
        lost = txn.unrecoverable()
        complete = txn.rollback()
        scope = "every update staged since the pause was" if staged else "the update was"
        if complete:
            current = self.versions.current
            return (
                f"{error}; {scope} rolled back: the weights and version {current!r} are "
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
        return {"values": view[: call.truncate_size].float().cpu().tolist()}

    def update_weight_version(self, call: UpdateWeightVersion) -> Result:
        """Publishes call.new_version: staged updates commit under it; otherwise a relabel."""
        if call.abort_all_requests:
            self.engine.abort_all()
        if self.txn is not None:
            return self._commit(self.txn, call.new_version)
        label = self.versions.publish(call.new_version)
        self.engine.publish_weight_version(label, weights_changed=False)
        return {"weight_version": label}

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
        self.engine.release_hold(PAUSED)
        self.paused_mode = None
        waiting = self.engine.held_by()
        note = f"; still held: {', '.join(waiting)}" if waiting else ""
        return {**out, "message": f"generation continues{note}"}

    def release_memory_occupation(self, call: ReleaseMemoryOccupation) -> Result:
        if self.txn is not None:
            raise InvalidRequest(
                "an update is staged; continue_generation (or update_weight_version) first"
            )
        return self.memory.release(list(call.tags))

    def resume_memory_occupation(self, call: ResumeMemoryOccupation) -> Result:
        out = self.memory.resume(list(call.tags))
        if out["weights_lost"]:
            self.missing = set(self.expected)
            self.engine.hold(MISSING)
        return out


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
    """The checkpoint loader (rollout.models.loader) refuses a file outside the allowed roots
    with OutsideRootsError and a malformed one with ValueError: both are the caller's to fix."""
    try:
        yield
    except RequestError:
        raise
    except OutsideRootsError as e:
        raise Forbidden(str(e)) from e
    except ValueError as e:
        raise InvalidRequest(str(e)) from e


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
