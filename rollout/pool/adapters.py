"""The pool's LoRA adapters: loaded on every replica or on none, and given back, with their
current values, to a replica that restarts.

`load_lora_adapter` runs on every replica that is up; if one refuses (the adapter does not fit,
no slot is free), the replicas that loaded it unload it again and the refusal is raised. An
unload that one replica refuses (a request there still uses the adapter) is undone the same
way, by loading it again where it was unloaded. The pool keeps each adapter's name and
directory, and where its updated values come from (adapter_source.py), so that a restarted
replica gets them again after its weights. Updates of an adapter's values (an update call with
lora_name) go through PoolWeights.update, all or nothing, as base-weight updates do.
"""

from __future__ import annotations

from rollout.pool.supervisor import Supervisor
from rollout.pool.weights import PoolWeights


class PoolAdapters:
    def __init__(self, supervisor: Supervisor, weights: PoolWeights) -> None:
        self.sup, self.weights = supervisor, weights
        self.sources = weights.adapters

    @property
    def loaded(self) -> dict[str, tuple[str, tuple[str, ...] | None]]:
        """name -> (path, roots) of each adapter loaded through the pool."""
        return {name: (path, roots) for name, path, roots in self.sources.pool_loads()}

    async def load(
        self, lora_name: str, lora_path: str, allowed_roots: tuple[str, ...] | None = None
    ) -> dict:
        async with self.weights.lock:
            results = await self.weights.fan_out(
                "load_lora_adapter", lora_name, lora_path, allowed_roots=allowed_roots,
                undo=("unload_lora_adapter", (lora_name,), {}),
            )  # fmt: skip
            self.sources.loaded(lora_name, lora_path, allowed_roots)
            return {**results[0], "replicas": len(results)}

    async def unload(self, lora_name: str) -> dict:
        async with self.weights.lock:
            path, roots = self.loaded.get(lora_name, (None, None))
            undo = None
            if path is not None:
                undo = ("load_lora_adapter", (lora_name, path), {"allowed_roots": roots})
            results = await self.weights.fan_out(
                "unload_lora_adapter", lora_name, undo=undo,
                after_undo=lambda done: self._values_again(lora_name, done),
            )  # fmt: skip
            self.sources.unloaded(lora_name)
            return {**results[0], "replicas": len(results)}

    async def _values_again(self, lora_name: str, reloaded: list[int]) -> None:
        """Replicas that loaded an adapter again from its load path get its updated values
        back; one that cannot is restarted (it would serve older values)."""
        if lora_name not in self.sources.entries:
            return
        for i in reloaded:
            try:
                await self.sources.push_values(self.sup.replicas[i], lora_name)
            except Exception as e:  # noqa: BLE001 - restarted, then restored or kept stale
                self.sup.mark_dead(i, f"LoRA adapter {lora_name!r} lost its values: {e}")
