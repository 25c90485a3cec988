"""The engine's LoRA adapters: which are loaded, under which version, and who uses them.

The scheduler process holds one LoraManager when the engine serves adapters (enable_lora). It
owns the model's AdapterSlots (rollout/models/lora.py) and answers, for the scheduler:

- whether a request's adapter is loaded (else the request is refused, naming the ones that are);
- the prefix-cache namespace of a request: (adapter name, load count), so KV computed under one
  adapter, or under an earlier load of the same name, is never reused by another;
- whether an adapter may be unloaded (not while a queued or running request uses it);
- for weight sync (rollout/weight_sync/adapter_update.py, as its AdapterPort): checking and
  writing new values of a loaded adapter, and each adapter's version label.

Versions: a request on an adapter reports the adapter's label as meta_info.weight_version (the
base model's label is for base requests). A load starts the label at "default"; an update names
the next one (weight_version), or keeps it when it names none, as for the base model's. Every
load or update of a name is a new prefix-cache namespace: KV computed under older values of an
adapter is never reused by a request attached later.

Loading, unloading and updating happen between steps, on the scheduler's control path.

With tensor parallelism every rank has a LoraManager over its slices of the slots. Rank 0's
loads and unloads act on every rank (`use_other_ranks`; the other ranks answer through
weight_sync.adapter_ranks.RankAdapters): an adapter is loaded on all ranks or on none.
Requests, namespaces and versions are rank 0's alone.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from rollout.errors import Forbidden, InvalidRequest
from rollout.lora_options import LoraOptions
from rollout.models.loader import OutsideRootsError
from rollout.models.lora import AdapterError, AdapterSlots, LoraAdapter, lora_module_shapes
from rollout.models.lora_adapter import read_peft_adapter
from rollout.weight_sync.adapter_ranks import OtherRankAdapters
from rollout.weight_sync.rank_sync import OtherRanks

logger = logging.getLogger(__name__)

DEFAULT_MAX_RANK = 64
INITIAL_VERSION = "default"  # an adapter's label from its load until an update names another
# Any rank is read while the slots' own bound is not known yet (adapters preloaded at start).
_ANY_RANK = 1 << 20

CacheNamespace = tuple[str, int] | None  # None: the base model's KV


class LoraManager:
    def __init__(self, model: nn.Module, options: LoraOptions, use_kernels: bool) -> None:
        """Reads the adapters of options.lora_paths, sizes the slots for them (max_lora_rank
        and lora_target_modules default to what they need) and loads them."""
        shapes = lora_module_shapes(model)
        preload = {
            name: read_peft_adapter(path, shapes, options.max_lora_rank or _ANY_RANK)
            for name, path in options.named_paths().items()
        }
        if len(preload) > options.max_loras_per_batch:
            raise ValueError(
                f"lora_paths names {len(preload)} adapters, more than max_loras_per_batch "
                f"({options.max_loras_per_batch})"
            )
        rank = options.max_lora_rank or max(
            (a.rank for a in preload.values()), default=DEFAULT_MAX_RANK
        )
        targets: str | Sequence[str] = options.lora_target_modules or sorted(
            {p for a in preload.values() for p in a.projections}
        ) or "all"  # fmt: skip
        self.slots = AdapterSlots(
            model, options.max_loras_per_batch, rank, targets, use_kernels=use_kernels
        )
        self._paths: dict[str, str] = {}  # loaded adapter name -> where it was read from
        # Adapter name -> how many loads wrote it, kept after an unload: each load of a name
        # is a new prefix-cache namespace.
        self._loads: dict[str, int] = {}
        self._versions: dict[str, str] = {}  # loaded adapter name -> its version label
        self._others: OtherRankAdapters | None = None  # rank 0's line to the other ranks
        for name, adapter in preload.items():
            self._load(name, options.named_paths()[name], adapter)

    # ---- requests ------------------------------------------------------------------------------
    def check_request(self, name: str) -> None:
        """InvalidRequest unless adapter `name` is loaded."""
        if name not in self._paths:
            loaded = ", ".join(sorted(self._paths)) or "none"
            raise InvalidRequest(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")

    def is_loaded(self, name: str) -> bool:
        return name in self._paths

    def namespace(self, name: str | None) -> CacheNamespace:
        """The prefix-cache namespace of a request on adapter `name` (None: the base model)."""
        return None if name is None else (name, self._loads[name])

    def prepare(self, names: Sequence[str | None], extend_lens: Sequence[int]) -> None:
        """Tells the layers each request's adapter before the next forward."""
        self.slots.prepare_batch(names, extend_lens)

    # ---- control calls ------------------------------------------------------------------------
    def load(self, name: str, path: str, roots: Sequence[str] | None) -> dict:
        """Reads the PEFT adapter at `path` (every file under `roots`, when given) into a free
        slot. Refused, changing nothing, when `name` is loaded already, the adapter does not
        fit the slots, or no slot is free."""
        if name in self._paths:
            raise InvalidRequest(
                f"a LoRA adapter named {name!r} is loaded already: unload it first, or load "
                f"the new one under another name"
            )
        try:
            adapter = self.slots.read(path, roots)
        except (FileNotFoundError, AdapterError) as e:
            raise InvalidRequest(f"LoRA adapter {name!r}: {e}") from None
        self._load(name, path, adapter)
        if self._others is not None:
            try:
                self._others.load(name, path, roots)
            except Exception:
                self._forget(name)
                raise
        return {"success": True, "message": f"loaded LoRA adapter {name!r}", **self.info()}

    def _load(self, name: str, path: str, adapter: LoraAdapter) -> None:
        try:
            self.slots.load(name, adapter)
        except AdapterError as e:
            raise InvalidRequest(f"LoRA adapter {name!r}: {e}") from None
        self._loads[name] = self._loads.get(name, 0) + 1
        self._paths[name] = path
        self._versions[name] = INITIAL_VERSION
        logger.info("loaded LoRA adapter %s from %s (rank %d)", name, path, adapter.rank)

    def unload(self, name: str, users: Iterable[str | None]) -> dict:
        """Frees adapter `name`'s slot. Refused while any request in `users` (the adapters of
        the queued and running requests) uses it: those would lose their adapter mid-way."""
        self.check_request(name)
        in_use = sum(1 for user in users if user == name)
        if in_use:
            raise InvalidRequest(
                f"LoRA adapter {name!r} is used by {in_use} queued or running request(s): "
                f"unload it when they have finished (or abort them)"
            )
        self._forget(name)
        if self._others is not None:
            self._others.unload(name)
        return {"success": True, "message": f"unloaded LoRA adapter {name!r}", **self.info()}

    def _forget(self, name: str) -> None:
        self.slots.unload(name)
        del self._paths[name]
        del self._versions[name]

    def use_other_ranks(self, ranks: OtherRanks) -> None:
        """Rank 0 of several: every load and unload from now on acts on `ranks` too."""
        self._others = OtherRankAdapters(ranks)

    # ---- weight sync (rollout/weight_sync/engine_port.AdapterPort) -----------------------------
    def version_of(self, name: str) -> str:
        """Adapter `name`'s version label (InvalidRequest when it is not loaded)."""
        self.check_request(name)
        return self._versions[name]

    def check_values(self, name: str, shapes: Iterable[tuple[str, Sequence[int]]]) -> None:
        """InvalidRequest unless PEFT-named tensors of these shapes are new values for some
        modules of loaded adapter `name` (AdapterSlots.check_values; the same names and shapes
        as its last update are known good)."""
        self.check_request(name)
        try:
            self.slots.value_writes(name, shapes)
        except AdapterError as e:
            raise InvalidRequest(f"LoRA adapter {name!r}: {e}") from None

    def write_values(self, name: str, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Writes checked new values (check_values) into adapter `name`'s slot; the number of
        modules written. The version is `publish`ed separately."""
        self.check_request(name)
        try:
            return self.slots.write_values(name, list(tensors))
        except AdapterError as e:
            raise InvalidRequest(f"LoRA adapter {name!r}: {e}") from None

    def read(self, name: str, path: str, roots: Sequence[str] | None) -> LoraAdapter:
        """The PEFT adapter in directory `path`, checked to replace loaded adapter `name`
        whole (any rank up to max_lora_rank, any modules within lora_target_modules).
        InvalidRequest for a bad adapter, Forbidden for a file outside `roots`."""
        self.check_request(name)
        try:
            return self.slots.read(path, roots)
        except (FileNotFoundError, AdapterError) as e:
            raise InvalidRequest(f"LoRA adapter {name!r}: {e}") from None
        except OutsideRootsError as e:
            raise Forbidden(f"LoRA adapter {name!r}: {e}") from None

    def replace(self, name: str, adapter: LoraAdapter, path: str) -> None:
        """Writes a checked adapter (`read`) over loaded adapter `name`, in its slot."""
        self.check_request(name)
        self.slots.load(name, adapter)
        self._paths[name] = path

    def publish(self, name: str, version: str | None) -> str:
        """After new values of adapter `name`: a new prefix-cache namespace (no request
        attached from now on reuses KV of its older values) and its label, `version` or the
        current one kept. Returns the label."""
        self.check_request(name)
        self._loads[name] += 1
        if version is not None:
            self._versions[name] = version
        return self._versions[name]

    def info(self) -> dict:
        return {
            "lora_adapters": dict(self._paths),
            "lora_weight_versions": dict(self._versions),
            "max_loras_per_batch": self.slots.num_slots,
            "max_lora_rank": self.slots.max_rank,
        }
