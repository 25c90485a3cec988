"""AdapterSources: for each LoRA adapter of the pool, where its current values can be had
again, and its version label (WeightSource's counterpart for adapters).

A replica that restarts loads its adapters again from where they were first loaded (its own
lora_paths, or the pool's load_lora_adapter): their original values. Before it takes traffic
the pool brings each updated adapter to what the others serve, under the same label:
- the last PEFT directory given by update_weights_from_disk(lora_name=...), loaded again (it
  replaces the adapter whole, so it is the starting point);
- then the tensor updates since, from the CPU copy the pool keeps (keep_tensor_snapshot);
- values that came by update_weights_from_distributed never pass through the pool:
  `restore_adapter(name)`, a callable returning the trainer's current adapter (a PEFT model, or
  a dict of PEFT name -> tensor), gives them. Without one the replica stays out of traffic as
  stale (it never serves an adapter's older values) until an update the pool can copy (disk,
  or tensors of every module that came by broadcast) reaches that adapter.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.pool.replica import Replica
from rollout.pool.supervisor import StaleWeights
from rollout.pool.weight_source import Named
from rollout.weight_sync.tensor_handles import TensorHandles

INITIAL_VERSION = "default"  # an adapter's label from its load (as one engine names it)
PEFT_PREFIX = "base_model.model."


@dataclass
class AdapterSource:
    """One adapter: how it was loaded, and what changed its values since."""

    load: tuple[str, tuple[str, ...] | None] | None  # (path, roots); None: at replica start
    version: str = INITIAL_VERSION
    disk: tuple[str, tuple[str, ...] | None] | None = None  # the last directory update
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # updates since, copied
    missing: set[str] = field(default_factory=set)  # tensors the pool holds no copy of
    why_missing: str | None = None


class AdapterSources:
    def __init__(self, restore_adapter: Callable[[str], Any] | None = None) -> None:
        self.restore_adapter = restore_adapter
        self.entries: dict[str, AdapterSource] = {}
        self.staged: dict[str, str] = {}  # adapter -> label of its updates staged while paused

    # ---- loads ----------------------------------------------------------------------------------
    def started_with(self, versions: dict[str, str]) -> None:
        """The adapters every replica loads itself at start (lora_paths), with their labels."""
        for name, version in versions.items():
            self.entries[name] = AdapterSource(None, version)

    def loaded(self, name: str, path: str, roots: tuple[str, ...] | None) -> None:
        self.entries[name] = AdapterSource((path, roots))

    def unloaded(self, name: str) -> None:
        self.entries.pop(name, None)
        self.staged.pop(name, None)

    def pool_loads(self) -> list[tuple[str, str, tuple[str, ...] | None]]:
        """(name, path, roots) of the adapters loaded through the pool, in load order."""
        return [(n, *e.load) for n, e in self.entries.items() if e.load is not None]

    # ---- updates --------------------------------------------------------------------------------
    def next_label(self, name: str, version: str | None) -> str:
        """An update without a label keeps the adapter's (or joins those staged before it)."""
        if version is not None:
            return version
        if name in self.staged:
            return self.staged[name]
        entry = self.entries.get(name)
        return entry.version if entry is not None else INITIAL_VERSION

    def record(
        self, name: str, method: str, args: tuple, kwargs: dict, label: str, copied: Named | None
    ) -> None:
        """An update of adapter `name` now serves on every replica as `label`; `copied` is
        the CPU copy of a tensor update's tensors (None when not kept)."""
        entry = self.entries.get(name)
        if entry is None:  # loaded behind the pool's back (replica_call): not restored
            return
        entry.version = label
        if method == "update_weights_from_disk":
            entry.disk = (args[0], kwargs.get("allowed_roots"))
            entry.tensors, entry.missing, entry.why_missing = {}, set(), None
        elif method == "update_weights_from_tensor":
            handles: TensorHandles = args[0]
            names = [_key(spec.name) for spec in handles.specs]
            if copied is None:
                _lose(entry, names, "a tensor update was not kept (keep_tensor_snapshot=False)")
                return
            entry.tensors.update((_key(n), t) for n, t in copied)
            entry.missing.difference_update(names)
        elif method == "update_weights_from_distributed":
            names = [_key(n) for n in kwargs["names"]]
            _lose(entry, names, "its values came by update_weights_from_distributed")

    # ---- a restarted replica --------------------------------------------------------------------
    def check_restorable(self) -> None:
        """StaleWeights, before anything is pushed, when an adapter's values cannot be had."""
        if self.restore_adapter is not None:
            return
        for name, entry in self.entries.items():
            if entry.missing:
                raise StaleWeights(
                    f"LoRA adapter {name!r}: {entry.why_missing} ({len(entry.missing)} "
                    "tensors) and the pool was given no restore_adapter to fetch them"
                )

    async def restore(self, replica: Replica) -> None:
        """Loads the pool's adapters on a freshly started replica, then brings every updated
        one to its current values and label (the caller has run check_restorable)."""
        for name, path, roots in self.pool_loads():
            await replica.call("load_lora_adapter", name, path, allowed_roots=roots)
        for name in self.entries:
            await self.push_values(replica, name)

    async def push_values(self, replica: Replica, name: str) -> None:
        """Brings adapter `name`, as loaded from its load path, to its current values and
        label on `replica` (StaleWeights when the pool cannot)."""
        entry = self.entries[name]
        if entry.missing and self.restore_adapter is None:
            raise StaleWeights(f"LoRA adapter {name!r}: {entry.why_missing}")
        label = {"weight_version": entry.version, "lora_name": name}
        if entry.disk is not None:
            path, roots = entry.disk
            await replica.call("update_weights_from_disk", path, allowed_roots=roots, **label)
        named = list(entry.tensors.items())
        if entry.missing:
            named = await asyncio.to_thread(self._provided, name)
        if named:
            await replica.call("update_weights_from_tensor", named, **label)

    def _provided(self, name: str) -> Named:
        from rollout.weight_sync import adapter_weights
        from rollout.weight_sync.sender import named_weights

        assert self.restore_adapter is not None
        given = self.restore_adapter(name)
        if isinstance(given, torch.nn.Module) and adapter_weights.has_lora(given):
            named = adapter_weights.lora_weights(given)
        else:
            named = named_weights(given)
        # On the host: they go by value, maybe to another node.
        return [(n, t.detach().to("cpu")) for n, t in named]


def _lose(entry: AdapterSource, names: list[str], why: str) -> None:
    for name in names:
        entry.tensors.pop(name, None)
        entry.missing.add(name)
    entry.why_missing = why


def _key(name: str) -> str:
    """One key per tensor, with or without PEFT's base_model.model. prefix."""
    return name.removeprefix(PEFT_PREFIX)
