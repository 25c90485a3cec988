"""WeightSource: where the pool's current weights can be had again, and their version label.

A restarted replica starts from its checkpoint (model_path) and must serve what the others
serve before it takes traffic. The pool remembers:
- the last checkpoint loaded by update_weights_from_disk (path, load_format, allowed roots),
  loaded again;
- every tensor update since that checkpoint (or since start), as a CPU copy per weight name
  (`keep_tensor_snapshot`; it costs one host copy of the weights pushed), pushed again;
- after an update_weights_from_distributed the pool has no copy of the weights it named (the
  trainer broadcasts straight to the replicas), until a checkpoint or tensor update replaces
  them: meanwhile `restore_weights`, a callable that returns the trainer's current weights (an
  nn.Module or a dict of HF name -> tensor), gives them; without it the replica stays out of
  traffic as stale until the next update that the pool can copy reaches it.

Labels: the pool names every update itself, the same name on every replica: the caller's
weight_version, or, as one engine does, the current label kept.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import torch

from rollout.pool.replica import Replica
from rollout.pool.supervisor import StaleWeights
from rollout.weight_sync.sender import named_weights
from rollout.weight_sync.tensor_handles import TensorHandles, open_tensors

Named = list[tuple[str, torch.Tensor]]
Snapshot = Callable[[], Named]


class WeightSource:
    def __init__(
        self, version: str, dtype: torch.dtype, keep_tensor_snapshot: bool = True,
        restore_weights: Callable[[], Any] | None = None,
    ) -> None:  # fmt: skip
        self.version = version
        self.dtype = dtype
        self.keep_tensor_snapshot = keep_tensor_snapshot
        self.restore_weights = restore_weights
        self.disk: tuple[str, str | None, Any] | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.missing: set[str] = set()  # weights whose current values the pool has no copy of
        self.why_missing: str | None = None

    def next_label(self, version: str | None) -> str:
        """An update without a label keeps the current one (as one engine does)."""
        return version if version is not None else self.version

    def capture(self, method: str, args: tuple, snapshot: Snapshot | None) -> Named | None:
        """A CPU copy of a tensor update's tensors (given by `snapshot`, else read from its
        handles), taken while the caller still holds them; None for other updates."""
        if method != "update_weights_from_tensor" or not self.keep_tensor_snapshot:
            return None
        if snapshot is not None:
            return [(n, t.detach().to("cpu", copy=True)) for n, t in snapshot()]
        opened = open_tensors(args[0])
        try:
            return [(n, t.to("cpu", copy=True)) for n, t in opened.named]
        finally:
            opened.close()

    def record(
        self, method: str, args: tuple, kwargs: dict, label: str, copied: Named | None
    ) -> None:
        """An update `method(*args, **kwargs)` now serves on every replica as `label`;
        `copied` is what `capture` took of it."""
        self._named(label)
        if method == "update_weights_from_disk":
            self.disk = (args[0], kwargs.get("load_format"), kwargs.get("allowed_roots"))
            self.tensors, self.missing, self.why_missing = {}, set(), None
        elif method == "update_weights_from_tensor":
            handles: TensorHandles = args[0]
            names = [spec.name for spec in handles.specs]
            if copied is None:
                self._lose(names, "a tensor update was not kept (keep_tensor_snapshot=False)")
                return
            self.tensors.update(copied)
            self.missing.difference_update(names)
        elif method == "update_weights_from_distributed":
            self._lose(kwargs["names"], "the weights came by update_weights_from_distributed")

    def _lose(self, names: Iterable[str], why: str) -> None:
        """The pool holds no copy of these weights' current values."""
        for name in names:
            self.tensors.pop(name, None)
            self.missing.add(name)
        self.why_missing = why

    def _named(self, label: str) -> None:
        self.version = label

    def relabel(self, version: str) -> None:
        self._named(version)

    async def restore(self, replica: Replica) -> None:
        """Brings a freshly started replica to the current weights and version (raises
        StaleWeights when the pool cannot)."""
        if self.missing:
            if self.restore_weights is None:
                raise StaleWeights(
                    f"{self.why_missing} ({len(self.missing)} weights) and the pool was given "
                    "no restore_weights to fetch them"
                )
            named = await asyncio.to_thread(self._provided)
            await replica.load_tensors(named, self.version)
            return
        pushed = False
        if self.disk is not None:
            path, load_format, roots = self.disk
            await replica.call(
                "update_weights_from_disk", path, load_format=load_format,
                weight_version=self.version, allowed_roots=roots,
            )  # fmt: skip
            pushed = True
        if self.tensors:
            await replica.load_tensors(list(self.tensors.items()), self.version)
            pushed = True
        if not pushed and await replica.call("get_weight_version") != self.version:
            await replica.call("update_weight_version", self.version)

    def _provided(self) -> Named:
        assert self.restore_weights is not None
        # On the host: they go by value, maybe to another node.
        provided = named_weights(self.restore_weights())
        return [(n, t.detach().to("cpu", self.dtype)) for n, t in provided]
