"""The pool's LoRA adapters: loaded on every replica or on none, and given back to a replica
that restarts.

`load_lora_adapter` runs on every replica that is up; if one refuses (the adapter does not fit,
no slot is free), the replicas that loaded it unload it again and the refusal is raised. An
unload that one replica refuses (a request there still uses the adapter) is undone the same
way, by loading it again where it was unloaded. The pool keeps each adapter's name and
directory so that a restarted replica gets them again after its weights.
"""

from __future__ import annotations

from rollout.pool.supervisor import Supervisor
from rollout.pool.weights import PoolWeights


class PoolAdapters:
    def __init__(self, supervisor: Supervisor, weights: PoolWeights) -> None:
        self.sup, self.weights = supervisor, weights
        self.loaded: dict[str, tuple[str, tuple[str, ...] | None]] = {}  # name -> (path, roots)

    async def load(
        self, lora_name: str, lora_path: str, allowed_roots: tuple[str, ...] | None = None
    ) -> dict:
        async with self.weights.lock:
            results = await self.weights.fan_out(
                "load_lora_adapter", lora_name, lora_path, allowed_roots=allowed_roots,
                undo=("unload_lora_adapter", (lora_name,), {}),
            )  # fmt: skip
            self.loaded[lora_name] = (lora_path, allowed_roots)
            return {**results[0], "replicas": len(results)}

    async def unload(self, lora_name: str) -> dict:
        async with self.weights.lock:
            path, roots = self.loaded.get(lora_name, (None, None))
            undo = None
            if path is not None:
                undo = ("load_lora_adapter", (lora_name, path), {"allowed_roots": roots})
            results = await self.weights.fan_out("unload_lora_adapter", lora_name, undo=undo)
            self.loaded.pop(lora_name, None)
            return {**results[0], "replicas": len(results)}

    async def restore(self, i: int) -> None:
        """Loads the pool's adapters on restarted replica i (after its weights)."""
        async with self.weights.lock:
            for name, (path, roots) in self.loaded.items():
                await self.sup.replicas[i].call(
                    "load_lora_adapter", name, path, allowed_roots=roots
                )
