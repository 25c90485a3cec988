"""LocalUpdates: one tensor-parallel rank's part of an update, the same on every rank.

For each source it checks every name, shape and dtype against the model before any byte is
loaded (a refused broadcast is still taken and dropped, so the trainer finishes its call), and
gives the tensors to load: full checkpoint tensors, of which the model keeps this rank's slice,
or (from disk, at tp > 1) only this rank's slices, read as such. What happens around the load
(the transaction, committing, versions) is the caller's: rank 0's WeightSyncController, or
another rank's RankWeights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from rollout.control import ControlCall
from rollout.errors import Forbidden, InvalidRequest, RequestError
from rollout.models.loader import OutsideRootsError
from rollout.weight_sync import disk_source, distributed_source, serialized_tensors
from rollout.weight_sync.calls import (
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)
from rollout.weight_sync.engine_port import EnginePort
from rollout.weight_sync.specs import WeightSpec, check_against_model
from rollout.weight_sync.tensor_handles import OpenedTensors, check_receivable, open_tensors
from rollout.weight_sync.update_groups import UpdateGroups

# Checks an update's specs before any tensor arrives (raising a RequestError): by default
# against the model's weights; a LoRA adapter's update (adapter_update.py) checks its own.
SpecCheck = Callable[[list[WeightSpec]], object]


@dataclass(frozen=True)
class Update:
    """An update as one rank loads it, checked against its model."""

    count: int  # tensors in the update
    tensors: Callable[[], Iterable[tuple[str, torch.Tensor]]]  # may raise midway
    streamed: bool  # it may fail after the first write: loaded with a backup
    presharded: bool = False  # the tensors are this rank's slices


class LocalUpdates:
    def __init__(
        self, engine: EnginePort, groups: UpdateGroups, released: Callable[[], bool],
        rank: int = 0, size: int = 1,
    ) -> None:  # fmt: skip
        """released(): whether the weights' memory is given back (no update may land then).
        rank, size: this rank's place among the engine's tensor-parallel ranks."""
        self.engine, self.model = engine, engine.model
        self.expected = self.model.hf_param_shapes()
        self.groups = groups
        self.released = released
        self.rank, self.size = rank, size
        self._ipc_open: OpenedTensors | None = None

    def check(self, specs: list[WeightSpec], exact_dtype: bool) -> list[WeightSpec]:
        if self.released():
            raise InvalidRequest("the weights are released; call resume_memory_occupation first")
        return check_against_model(specs, self.expected, self.model.is_ignored_weight, exact_dtype)

    @contextlib.contextmanager
    def open(self, call: ControlCall) -> Iterator[Update]:
        """The update of `call` (any of the three sources), checked; its handles (if any) stay
        open until the block ends."""
        if isinstance(call, UpdateWeightsFromDistributed):
            yield self.distributed(call)
        elif isinstance(call, UpdateWeightsFromTensor):
            with self.tensor(call) as update:
                yield update
        elif isinstance(call, UpdateWeightsFromDisk):
            yield self.disk(call)
        else:
            raise TypeError(f"{type(call).__name__} is no weight update")

    def _exact(self, specs: list[WeightSpec]) -> list[WeightSpec]:
        return self.check(specs, exact_dtype=True)

    def distributed(
        self, call: UpdateWeightsFromDistributed, check: SpecCheck | None = None
    ) -> Update:
        group = self.groups.get(call.group_name)
        specs = call.specs
        units = distributed_source.broadcast_units(specs, call.load_format)
        try:
            (check or self._exact)(specs)
        except RequestError:
            distributed_source.drain(group, units, call.load_format)  # the trainer is sending: let it finish
            raise
        stream = lambda: distributed_source.receive(group, units, call.load_format)  # noqa: E731
        # One broadcast (a flattened bucket, or a single tensor) arrives whole before the first
        # write: nothing to back up for a call that stands alone.
        return Update(len(specs), stream, streamed=len(units) > 1)

    @contextlib.contextmanager
    def tensor(
        self, call: UpdateWeightsFromTensor, check: SpecCheck | None = None
    ) -> Iterator[Update]:
        if call.serialized_named_tensors is not None:
            yield self.serialized(call, check)
            return
        handles = call.handles_for(self.rank, self.size)
        check_receivable(handles)
        (check or self._exact)(handles.specs)
        opened: list[OpenedTensors] = []

        def source() -> Iterable[tuple[str, torch.Tensor]]:
            opened.append(open_tensors(handles))
            return opened[0].named

        try:
            yield Update(len(handles.tensors), source, streamed=False)
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

    def serialized(self, call: UpdateWeightsFromTensor, check: SpecCheck | None = None) -> Update:
        """SGLang's payload for this rank, opened (restricted unpickler) and checked before any
        weight is written; its tensors are views of the sender's memory."""
        payload = call.payload_for(self.rank, self.size)
        named = serialized_tensors.load_named_tensors(payload, call.load_format)
        specs = [WeightSpec(n, tuple(t.shape), t.dtype) for n, t in named]
        (check or self._exact)(specs)
        return Update(len(named), lambda: named, streamed=False)

    def disk(self, call: UpdateWeightsFromDisk) -> Update:
        """Every file opened must resolve under one of call.allowed_roots (None: anywhere)."""
        path, roots = call.model_path, call.allowed_roots
        with _checkpoint_errors():
            disk_source.check_config(path, self.engine.hf_config, roots)
            found = disk_source.read_specs(path, roots)
        specs = [spec for _, spec in found.values()]
        keep = self.check(specs, exact_dtype=False)
        lacking = sorted(set(self.expected) - {s.name for s in keep})
        if lacking:
            raise InvalidRequest(
                f"checkpoint {path!r} lacks {len(lacking)} weights, e.g. {lacking[:3]}"
            )
        names = [s.name for s in specs]
        # With tensor parallelism each rank reads only its slices.
        shard_of = self.model.hf_shard if self.size > 1 else None

        def read() -> list[tuple[str, torch.Tensor]]:
            with _checkpoint_errors():
                return disk_source.read_tensors(found, names, path, roots, shard_of)

        return Update(len(specs), read, streamed=False, presharded=shard_of is not None)


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
