"""AdapterUpdates: weight sync of a loaded LoRA adapter (an update call with `lora_name`).

A LoRA trainer pushes only its adapter: the tensors are PEFT-named
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, with or without the
`base_model.model.` prefix, or a live PeftModel's `...lora_A.default.weight`), any floating
dtype (the slots cast). Each source, all or nothing:

- tensor and distributed: new values for some or all of the modules the adapter was loaded
  with, each module with both halves at the adapter's rank (rank, alpha and which modules it
  adapts are fixed at load: a different adapter is loaded from a directory). The names and
  shapes are checked before any tensor is opened or received (a refused broadcast is still
  taken and dropped, so the trainer finishes its call); a broadcast is received whole before
  the first write, so a transfer that fails midway changes nothing.
- disk: `model_path` is a PEFT adapter directory that replaces the adapter whole (any rank up
  to max_lora_rank, any modules within lora_target_modules), read and checked first.

After the write the adapter's version is published (EnginePort.publish_adapter_version): its
requests' outputs carry the update's weight_version (none: the adapter's label is kept), and no
request attached later reuses KV of its older values. The base model's weights and version are
untouched.

While generation is paused, updates are staged instead (copies of their tensors: the sender may
reuse its buffers) and written together at continue_generation (or update_weight_version);
discard_staged_weights drops them. A staged update that no longer fits at that point (its
adapter was unloaded meanwhile) is dropped, and the reply says so.

With tensor parallelism rank 0 runs this, and every other rank receives each update too
(adapter_ranks.py): all of them take it in whole and check it before any writes its slices,
so a refusal or a failed transfer on any rank changes no rank's adapter.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.errors import InvalidRequest, RequestError
from rollout.weight_sync.adapter_ranks import OtherRankAdapters
from rollout.weight_sync.calls import (
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    UpdateWeightsFromTensor,
)
from rollout.weight_sync.engine_port import AdapterPort, EnginePort
from rollout.weight_sync.flat_bucket import FlatBucket
from rollout.weight_sync.local_update import LocalUpdates
from rollout.weight_sync.rank_sync import OtherRanks
from rollout.weight_sync.specs import WeightSpec

logger = logging.getLogger(__name__)

Result = dict[str, Any]
AdapterCall = UpdateWeightsFromTensor | UpdateWeightsFromDistributed | UpdateWeightsFromDisk


@dataclass
class _Staged:
    """One adapter's updates staged while paused, in the order they came."""

    writes: list[Callable[[AdapterPort], object]] = field(default_factory=list)
    version: str | None = None  # the last one named


class AdapterUpdates:
    def __init__(self, engine: EnginePort, local: Callable[[], LocalUpdates]) -> None:
        """local(): the controller's LocalUpdates now (its sources and released weights)."""
        self.engine = engine
        self._local = local
        self.staged: dict[str, _Staged] = {}  # adapter name -> its staged updates
        self.others: OtherRankAdapters | None = None  # the other tensor-parallel ranks

    def _adapters(self, name: str) -> AdapterPort:
        adapters = self.engine.adapters
        if adapters is None:
            raise InvalidRequest(
                "lora_name names a LoRA adapter, but this engine serves none: start it with "
                "enable_lora (or lora_paths)"
            )
        adapters.version_of(name)  # InvalidRequest unless it is loaded
        if self._local().released():
            raise InvalidRequest("the weights are released; call resume_memory_occupation first")
        return adapters

    def _check(self, name: str) -> Callable[[list[WeightSpec]], None]:
        """The check of a tensor or distributed update's specs, run before any tensor is opened
        or received (a refused broadcast is then drained: every refusal must happen here)."""

        def check(specs: list[WeightSpec]) -> None:
            adapters = self._adapters(name)
            bad = [s.name for s in specs if not s.dtype.is_floating_point]
            if bad:
                raise InvalidRequest(f"LoRA weights must be floating-point tensors: {bad[:3]}")
            adapters.check_values(name, [(s.name, s.shape) for s in specs])

        return check

    def use_other_ranks(self, ranks: OtherRanks) -> None:
        """With tensor parallelism (on rank 0): every rank receives each update and keeps
        it, and writes its slices only once every rank has it (adapter_ranks.py)."""
        self.others = OtherRankAdapters(ranks)

    # ---- the three sources ------------------------------------------------------------------
    def update(self, call: AdapterCall, staged: bool) -> Result:
        """Runs an update with call.lora_name: written and published now, or with `staged`
        (generation paused) kept until `commit`."""
        name = call.lora_name
        assert name is not None
        if self.others is None:
            with self.received(call, keep=staged) as write:
                return self._apply(name, write, call, staged)
        update_id = self.others.start_load(call)
        with contextlib.ExitStack() as stack:
            try:
                write = stack.enter_context(self.received(call, keep=staged))
            except Exception:
                self.others.abandon(update_id)
                raise
            self.others.check_loaded(update_id)
            write = self.others.writing_everywhere(update_id, write)
            return self._apply(name, write, call, staged)

    @contextlib.contextmanager
    def received(self, call: AdapterCall, keep: bool) -> Iterator[Callable[[AdapterPort], object]]:
        """Checks and takes in the update of `call` whole, writing nothing; yields its write,
        which may run within the block, or after it with `keep` (it then holds its own copies
        of the values: the sender's buffers are only ours until its call returns)."""
        name = call.lora_name
        assert name is not None
        if isinstance(call, UpdateWeightsFromDisk):
            adapter = self._adapters(name).read(name, call.model_path, call.allowed_roots)
            path = call.model_path
            yield lambda port: port.replace(name, adapter, path)
            return
        local = self._local()
        if isinstance(call, UpdateWeightsFromDistributed):
            update = local.distributed(call, self._check(name))
            named = list(update.tensors())  # every broadcast, before the first write
            yield _values(name, named, keep=False)  # received into buffers of its own
            return
        with local.tensor(call, self._check(name)) as update:
            named = list(update.tensors())
            try:
                yield _values(name, named, keep)
            finally:
                _finish_reading(named)

    def _apply(
        self, name: str, write: Callable[[AdapterPort], object], call: AdapterCall, staged: bool
    ) -> Result:
        if staged:
            entry = self.staged.setdefault(name, _Staged())
            entry.writes.append(write)
            entry.version = call.weight_version or entry.version
            message = (
                f"staged an update of LoRA adapter {name!r}; it applies at continue_generation"
            )
            return {"message": message, "staged": True, "lora_name": name}
        adapters = self.engine.adapters
        assert adapters is not None
        modules = write(adapters)
        label = self.engine.publish_adapter_version(name, call.weight_version)
        what = f"{modules} modules of" if isinstance(modules, int) else "the whole of"
        return {
            "message": f"loaded {what} LoRA adapter {name!r}",
            "weight_version": label,
            "lora_name": name,
        }

    # ---- staged updates ---------------------------------------------------------------------
    def commit(self) -> Result:
        """Writes every staged update and publishes each adapter's version. An adapter whose
        staged update no longer fits is skipped (the reply names it); the others apply."""
        staged, self.staged = self.staged, {}
        if not staged:
            return {}
        versions, dropped = {}, []
        adapters = self.engine.adapters
        for name, entry in staged.items():
            written = 0
            try:
                if adapters is None:
                    raise InvalidRequest("the engine serves no LoRA adapters")
                adapters.version_of(name)
                for write in entry.writes:
                    write(adapters)
                    written += 1
            except (RequestError, ValueError) as e:
                logger.warning("a staged update of LoRA adapter %s was dropped: %s", name, e)
                dropped.append(f"{name}: {e}")
                if not written:
                    continue
            versions[name] = self.engine.publish_adapter_version(name, entry.version)
        if dropped and self.others is not None:  # what the other ranks kept of them
            self.others.drop_all()
        out: Result = {"lora_weight_versions": versions} if versions else {}
        if dropped:
            out["lora_updates_dropped"] = dropped
        return out

    def discard(self) -> int:
        """Drops every staged update; how many there were."""
        count = sum(len(entry.writes) for entry in self.staged.values())
        self.staged = {}
        if self.others is not None:
            self.others.drop_all()
        return count

    def info(self) -> dict[str, int]:
        return {"lora_update_staged": sum(len(e.writes) for e in self.staged.values())}


def _finish_reading(named: list[tuple[str, torch.Tensor]]) -> None:
    """Waits for the copies queued from `named`, the sender's memory: it may reuse that once
    its call returns."""
    for device in {t.device for _, t in named if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()


def _values(
    name: str, named: list[tuple[str, torch.Tensor]], keep: bool
) -> Callable[[AdapterPort], int]:
    """The write of new values; with `keep`, of copies made now (the sender's buffers are
    only ours until its call returns), in one buffer: one allocation and one batched copy."""
    if keep:
        named = FlatBucket.pack(named, shared=False).views()
    return lambda adapters: adapters.write_values(name, named)
