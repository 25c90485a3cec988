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

from rollout.config import EngineOptions
from rollout.engine.messages import AbortRequest
from rollout.models.loader import OutsideRootsError
from rollout.weight_sync import disk_source, distributed_source
from rollout.weight_sync.calls import PAUSE_MODES
from rollout.weight_sync.deferred import Deferred
from rollout.weight_sync.memory import MemoryOccupation, check_tags
from rollout.weight_sync.specs import WeightSpec, build_specs, check_against_model
from rollout.weight_sync.tensor_handles import (
    OpenedTensors,
    TensorHandles,
    check_receivable,
    open_tensors,
)
from rollout.weight_sync.transaction import HostBuffers, WeightTransaction
from rollout.weight_sync.update_group import WeightSyncError
from rollout.weight_sync.update_groups import UpdateGroups
from rollout.weight_sync.versions import VersionLabels

logger = logging.getLogger(__name__)

PAUSED, MISSING = "paused", "weights_missing"  # scheduler holds
TP_RANK = 0  # one scheduler process per engine for now


class WeightSyncController:
    def __init__(self, runner: Any, scheduler: Any, options: EngineOptions) -> None:
        self.runner, self.scheduler, self.model = runner, scheduler, runner.model
        self.opts = options.weight_sync
        self.expected = self.model.hf_param_shapes()
        self.versions = VersionLabels(scheduler.weight_version)
        self.memory = MemoryOccupation(runner, scheduler, self.opts.enable_weights_cpu_backup)
        self.groups = UpdateGroups(runner.device)
        self.host_buffers = HostBuffers()
        self.txn: WeightTransaction | None = None  # staged while paused
        self.txn_version: str | None = None
        self.paused_mode: str | None = None
        self.missing: set[str] = set()
        self._ipc_open: OpenedTensors | None = None

    def methods(self) -> dict[str, Callable[..., dict | Deferred]]:
        calls = (
            self.init_weights_update_group, self.destroy_weights_update_group,
            self.update_weights_from_distributed, self.update_weights_from_tensor,
            self.update_weights_from_disk, self.get_weights_by_name, self.get_weight_version,
            self.update_weight_version, self.pause_generation, self.continue_generation,
            self.release_memory_occupation, self.resume_memory_occupation,
        )  # fmt: skip
        return {fn.__name__: _reported(fn) for fn in calls}

    def info(self) -> dict[str, Any]:
        return {
            "generation_paused": self.paused_mode,
            "weights_missing": len(self.missing),
            "weight_update_staged": len(self.txn.loaded) if self.txn else 0,
            **self.groups.info(),
            **self.memory.info(),
        }

    # ---- update groups ----------------------------------------------------------------------
    def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        group_name: str, backend: str, timeout_s: float | None = None,
    ) -> Deferred:  # fmt: skip
        if backend == "nccl" and self.runner.device.type != "cuda":
            raise ValueError("the nccl backend needs the engine on a GPU; use backend='gloo'")
        return self.groups.join(
            master_address, master_port, rank_offset + TP_RANK, world_size, group_name, backend,
            timeout_s or self.opts.weight_sync_timeout_s,
        )  # fmt: skip

    def destroy_weights_update_group(self, group_name: str) -> dict | Deferred:
        retry = lambda: self.destroy_weights_update_group(group_name)  # noqa: E731
        return self.groups.after_join(group_name, retry) or self.groups.leave(group_name)

    # ---- the three sources ------------------------------------------------------------------
    def update_weights_from_distributed(
        self, names: list, dtypes: list, shapes: list, group_name: str,
        flush_cache: bool = True, weight_version: str | None = None, load_format: str | None = None,
    ) -> dict | Deferred:  # fmt: skip
        # NOTE: flush_cache is accepted for SGLang's signature; KV from older weights is never
        # reused whatever it says (see Scheduler.publish_weight_version).
        args = names, dtypes, shapes, group_name, flush_cache, weight_version, load_format
        retry = lambda: self.update_weights_from_distributed(*args)  # noqa: E731
        waiting = self.groups.after_join(group_name, retry)
        if waiting is not None:
            return waiting
        with self._all_or_nothing():
            return self._from_distributed(names, dtypes, shapes, group_name, weight_version, load_format)

    def _from_distributed(
        self, names: list, dtypes: list, shapes: list, group_name: str, weight_version: str | None,
        load_format: str | None,
    ) -> dict:  # fmt: skip
        distributed_source.check_load_format(load_format)
        group = self.groups.get(group_name)
        specs = build_specs(names, dtypes, shapes)
        units = distributed_source.broadcast_units(specs, load_format)
        try:
            self._check(specs, exact_dtype=True)
        except ValueError:
            distributed_source.drain(group, units)  # the trainer is sending: let it finish
            raise
        stream = lambda: distributed_source.receive(group, units)  # noqa: E731
        return self._update(specs, stream, True, streamed=True, version=weight_version)

    def update_weights_from_tensor(
        self, handles: dict, flush_cache: bool = True, weight_version: str | None = None
    ) -> dict:
        with self._all_or_nothing():
            return self._from_tensor(handles, weight_version)

    def _from_tensor(self, handles: dict, weight_version: str | None) -> dict:
        parsed = TensorHandles.from_json(handles)
        check_receivable(parsed)
        opened: list[OpenedTensors] = []

        def source() -> Iterable:
            opened.append(open_tensors(parsed))
            return opened[0].named

        try:
            return self._update(parsed.specs, source, True, streamed=False, version=weight_version)
        finally:
            if opened and parsed.kind == "cuda":
                # CUDA handles stay open until the next call (opened before the previous ones
                # close): a sender reusing its buffers then hits torch's cache of open handles.
                previous, self._ipc_open = self._ipc_open, opened[0]
                if previous is not None:
                    previous.close()
            elif opened:
                opened[0].close()

    def update_weights_from_disk(
        self, model_path: str, load_format: str | None = None, weight_version: str | None = None,
        allowed_roots: list[str] | None = None,
    ) -> dict:  # fmt: skip
        """allowed_roots: every file opened must resolve under one of them (None: anywhere)."""
        with self._all_or_nothing():
            return self._from_disk(model_path, load_format, weight_version, allowed_roots)

    def _from_disk(
        self, model_path: str, load_format: str | None, weight_version: str | None,
        roots: list[str] | None,
    ) -> dict:  # fmt: skip
        disk_source.check_load_format(load_format)
        disk_source.check_config(model_path, self.runner.hf_config, roots)
        found = disk_source.read_specs(model_path, roots)
        specs = [spec for _, spec in found.values()]
        keep = self._check(specs, exact_dtype=False)
        lacking = sorted(set(self.expected) - {s.name for s in keep})
        if lacking:
            raise ValueError(f"checkpoint {model_path!r} lacks {len(lacking)} weights, e.g. {lacking[:3]}")
        names = [s.name for s in specs]
        read = lambda: disk_source.read_tensors(found, names, model_path, roots)  # noqa: E731
        return self._update(specs, read, False, streamed=False, version=weight_version)

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
            raise _failure_kind(e)(self._roll_back(self.txn, e)) from e

    def _check(self, specs: list[WeightSpec], exact_dtype: bool) -> list[WeightSpec]:
        if "weights" in self.memory.released:
            raise ValueError("the weights are released; call resume_memory_occupation first")
        return check_against_model(specs, self.expected, self.model.is_ignored_weight, exact_dtype)

    def _update(
        self, specs: list[WeightSpec], source: Callable[[], Iterable], exact_dtype: bool,
        streamed: bool, version: str | None,
    ) -> dict:  # fmt: skip
        """Validates `specs`, then loads what `source()` yields. A `streamed` source may fail
        midway, so it is loaded with a backup; the others hold every tensor before the first
        write. While paused the update joins the staged transaction instead of committing."""
        self._check(specs, exact_dtype)
        staged = PAUSED in self.scheduler.holds
        txn = self.txn
        if txn is None:
            backup = self.opts.weight_update_backup if streamed or staged else None
            txn = WeightTransaction(self.model, backup, self.host_buffers, frozenset(self.missing))
        try:
            for name, tensor in source():
                txn.load(name, tensor)
            txn.wait()
        except Exception as e:
            raise _failure_kind(e)(self._roll_back(txn, e)) from e
        if staged:
            self.txn, self.txn_version = txn, version or self.txn_version
            return {"message": f"staged {len(specs)} tensors; they apply at continue_generation", "staged": True}
        return self._commit(txn, version)

    def _commit(self, txn: WeightTransaction, version: str | None) -> dict:
        names = txn.commit()
        self.txn, self.txn_version = None, None
        self.missing.difference_update(names)
        if not self.missing:
            self.scheduler.holds.discard(MISSING)
        label = self.versions.publish(version)
        self.scheduler.publish_weight_version(label, weights_changed=True)
        return {"message": f"loaded {len(names)} weights", "weight_version": label}

    def _roll_back(self, txn: WeightTransaction, error: Exception) -> str:
        staged = self.txn is not None
        self.txn, self.txn_version = None, None
        lost = txn.unrecoverable()
        complete = txn.rollback()
        scope = "every update staged since the pause was" if staged else "the update was"
        if complete:
            return f"{error}; {scope} rolled back: the weights and version {self.versions.current!r} are unchanged"
        self.missing.update(lost)
        self.scheduler.holds.add(MISSING)
        return (
            f"{error}; {len(lost)} weights were overwritten with no backup to restore, e.g. "
            f"{lost[:3]}: generation waits until they are pushed again"
        )

    # ---- reading and versions ---------------------------------------------------------------
    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> dict:
        if "weights" in self.memory.released:
            raise ValueError("the weights are released; call resume_memory_occupation first")
        try:
            view = self.model.hf_weight(name)
        except KeyError:
            raise ValueError(f"unknown weight name {name!r}") from None
        return {"values": view[:truncate_size].float().cpu().tolist()}

    def get_weight_version(self) -> dict:
        return {"weight_version": self.versions.current}

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> dict:
        """Publishes `new_version`: staged updates commit under it; otherwise a relabel."""
        if abort_all_requests:
            self.scheduler.abort(AbortRequest(abort_all=True))
        if self.txn is not None:
            return self._commit(self.txn, new_version)
        label = self.versions.publish(new_version)
        self.scheduler.publish_weight_version(label, weights_changed=False)
        return {"weight_version": label}

    # ---- pausing and memory -----------------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> dict:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        affected = len(self.scheduler.running) + len(self.scheduler.waiting)
        if mode == "abort":
            self.scheduler.abort(AbortRequest(abort_all=True))
        elif mode == "retract":
            affected = self.scheduler.retract_all()
        self.scheduler.holds.add(PAUSED)
        self.paused_mode = mode
        return {"message": f"paused ({mode}); {affected} requests affected"}

    def continue_generation(self) -> dict:
        out = self._commit(self.txn, self.txn_version) if self.txn is not None else {}
        self.scheduler.holds.discard(PAUSED)
        self.paused_mode = None
        waiting = sorted(h for h in self.scheduler.holds)
        note = f"; still held: {', '.join(waiting)}" if waiting else ""
        return {**out, "message": f"generation continues{note}"}

    def release_memory_occupation(self, tags: list[str] | None = None) -> dict:
        if self.txn is not None:
            raise ValueError("an update is staged; continue_generation (or update_weight_version) first")
        return self.memory.release(check_tags(tags))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> dict:
        out = self.memory.resume(check_tags(tags))
        if out["weights_lost"]:
            self.missing = set(self.expected)
            self.scheduler.holds.add(MISSING)
        return out


def _failure_kind(error: Exception) -> type[Exception]:
    """What a failed update raises, its message saying what was rolled back."""
    if isinstance(error, OutsideRootsError):
        return OutsideRootsError
    return ValueError if isinstance(error, (ValueError, TypeError)) else WeightSyncError


def _reported(fn: Callable[..., dict | Deferred]) -> Callable[..., dict | Deferred]:
    """Runs a control call; its result, or its failure as {"success": False, ...}."""
    return lambda **kwargs: _outcome(fn.__name__, lambda: fn(**kwargs))


def _outcome(name: str, run: Callable[[], dict | Deferred]) -> dict | Deferred:
    try:
        out = run()
    except (ValueError, TypeError, KeyError) as e:
        return {"success": False, "error": type(e).__name__, "message": str(e)}
    except OutsideRootsError as e:
        return {"success": False, "error": "PermissionError", "message": str(e)}
    except WeightSyncError as e:
        logger.warning("%s failed: %s", name, e)
        return {"success": False, "error": "WeightSyncError", "message": str(e)}
    except Exception as e:  # noqa: BLE001 - every failure must reach the caller
        logger.exception("%s failed", name)
        return {"success": False, "error": "WeightSyncError", "message": f"{type(e).__name__}: {e}"}
    if isinstance(out, Deferred):
        return Deferred(out.done, lambda: _outcome(name, out.finish))
    return {"success": True, "message": "", **out}
