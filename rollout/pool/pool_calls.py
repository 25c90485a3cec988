"""PoolCalls: each control call of the engine's API, as the pool runs it.

Weight, version, pause and memory calls go to PoolWeights (every replica, all or nothing); any
other call fans out to every replica, undone where one fails; reads (a weight's
values, the version, server info) are answered by one replica or by the pool itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import fields
from typing import Any

from rollout.control import ControlCall
from rollout.pool.adapters import PoolAdapters
from rollout.pool.dispatch import Dispatcher
from rollout.pool.server_info import merge_info
from rollout.pool.supervisor import Supervisor
from rollout.pool.weights import PoolWeights

UPDATES = ("update_weights_from_disk", "update_weights_from_distributed")


class PoolCalls:
    def __init__(
        self, supervisor: Supervisor, dispatcher: Dispatcher, weights: PoolWeights,
        adapters: PoolAdapters,
    ) -> None:  # fmt: skip
        self.sup, self.dispatcher, self.weights = supervisor, dispatcher, weights
        self.adapters = adapters

    async def run(self, call: ControlCall) -> Any:
        args = {f.name: getattr(call, f.name) for f in fields(call)}
        method, weights = call.method, self.weights
        if method in UPDATES:
            if args.get("lora_name") is None:
                args.pop("lora_name", None)
            version = args.pop("weight_version")
            positional = (args.pop("model_path"),) if "model_path" in args else ()
            return await weights.update(method, positional, args, version)
        handlers: dict[str, Callable[[], Awaitable[Any]]] = {
            "init_weights_update_group": lambda: weights.init_group(**args),
            "destroy_weights_update_group": lambda: weights.destroy_group(**args),
            "update_weight_version": lambda: weights.relabel(**args),
            "pause_generation": lambda: weights.pause(**args),
            "continue_generation": weights.resume_generation,
            "release_memory_occupation": lambda: weights.memory(method, **args),
            "resume_memory_occupation": lambda: weights.memory(method, **args),
            "get_weights_by_name": lambda: self._weights_by_name(**args),
            "get_weight_version": self._version,
            "get_server_info": self.server_info,
            "flush_cache": self.flush,
            "abort_request": lambda: self.dispatcher.abort(args["rid"], args["abort_all"]),
            "load_lora_adapter": lambda: self.adapters.load(**args),
            "unload_lora_adapter": lambda: self.adapters.unload(**args),
        }
        if method in handlers:
            return await handlers[method]()
        async with weights.lock:  # any other call: every replica, undone on failure
            results = await weights.fan_out(method, **args)
        return {**results[0], "replicas": len(results)} if results else {"success": True}

    async def server_info(self) -> dict:
        sup = self.sup
        up = sup.up()
        answers = await asyncio.gather(
            *(sup.call(i, "get_server_info") for i in up), return_exceptions=True
        )
        infos: list[dict | None] = [None] * len(sup.replicas)
        for i, answer in zip(up, answers):
            infos[i] = None if isinstance(answer, BaseException) else answer
        pool = {
            "weight_version": self.weights.source.version,
            "weight_updates": self.weights.weight_updates,
            "generation_paused": self.weights.paused,
            "weight_group_ranks": sum(r.ranks for r in sup.replicas),
            "num_replicas": len(sup.replicas),
            "num_serving": len(sup.serving()),
        }
        return merge_info(infos, sup.info(), self.dispatcher.router.stats(), pool)

    async def flush(self) -> dict:
        """success only when every replica flushed (none does while requests run)."""
        results = await self.weights.fan_out("flush_cache")
        ok = all(r.get("success") for r in results)
        message = "" if ok else "a replica had requests running"
        return {"success": ok, "message": message, "replicas": results}

    async def _weights_by_name(self, name: str, truncate_size: int) -> dict:
        values = await self.dispatcher.call_one("get_weights_by_name", name, truncate_size)
        return {"success": True, "values": values}

    async def _version(self) -> dict:
        return {"success": True, "weight_version": self.weights.source.version}
