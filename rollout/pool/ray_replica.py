"""A replica as a Ray actor that owns one RolloutEngine (its scheduler and detokenizer
processes are the actor's children, on the actor's node and GPUs).

The actor is an async actor: generation is awaited on its event loop, and every blocking
engine call (a weight update waits for the trainer's broadcast) runs on a thread, so requests
keep flowing while one waits. The pool's side (`RayReplica`) turns a dead actor (RayActorError)
or a dead engine (EngineDeadError) into ReplicaDead, and the engine's own refusals back into
their original exceptions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

from rollout.engine.tokenizer_manager import EngineDeadError
from rollout.generate_request import GenerateRequest
from rollout.pool.replica import Replica, ReplicaDead
from rollout.weight_sync.tensor_handles import TensorHandles

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
PING_TIMEOUT_S = 10.0
_HANDLES = "__tensor_handles__"  # TensorHandles travel as their JSON form, never pickled


class EngineActor:
    """The actor's class (made remote by RayReplica): one RolloutEngine and its methods."""

    def __init__(self, model_path: str, options: dict[str, Any]) -> None:
        from rollout.engine.engine import RolloutEngine

        self.engine = RolloutEngine(model_path, **options)

    async def info(self) -> dict:
        return await asyncio.to_thread(self.engine.get_server_info)

    async def pid(self) -> int:
        return os.getpid()

    async def generate(self, request: GenerateRequest) -> Any:
        return await self.engine.async_generate(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        async for out in await self.engine.async_generate(request):
            yield out

    async def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        args = tuple(_from_wire(a) for a in args)
        kwargs = {k: _from_wire(v) for k, v in kwargs.items()}
        return await asyncio.to_thread(getattr(self.engine, method), *args, **kwargs)

    async def alive(self) -> tuple[bool, str | None]:
        return self.engine.is_alive(), self.engine.dead_reason

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.engine.shutdown)


def _to_wire(value: Any) -> Any:
    return {_HANDLES: value.to_json()} if isinstance(value, TensorHandles) else value


def _from_wire(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {_HANDLES}:
        return TensorHandles.from_json(value[_HANDLES])
    return value


class RayReplica(Replica):
    """Replica `index` of a pool: an EngineActor placed on bundle `index` of the pool's
    placement group (one bundle: one node, the replica's CPUs and GPUs)."""

    def __init__(
        self, index: int, model_path: str, options: dict[str, Any], placement_group: Any,
        num_cpus: float, num_gpus: float, runtime_env: dict | None = None,
    ) -> None:  # fmt: skip
        self.index, self.name = index, f"replica {index}"
        self.model_path, self.options = model_path, options
        self.placement_group = placement_group
        self.num_cpus, self.num_gpus, self.runtime_env = num_cpus, num_gpus, runtime_env
        self.actor: Any = None
        self.unresponsive = False  # it failed to answer a ping: stopped without the graceful wait
        self.ranks = int(options.get("tp_size", 1))

    async def start(self) -> dict:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        await self.stop()
        strategy = PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=self.index
        )
        remote = ray.remote(EngineActor).options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=strategy,
            max_restarts=0, runtime_env=self.runtime_env, name=None,
        )  # fmt: skip
        self.actor = remote.remote(self.model_path, self.options)
        info = await self._await(self.actor.info.remote(), START_TIMEOUT_S)
        self.ranks = int(info.get("tp_size", 1))
        return info

    async def generate(self, request: GenerateRequest) -> Any:
        return await self._await(self._actor().generate.remote(request))

    async def stream(self, request: GenerateRequest) -> AsyncIterator[dict]:
        refs = self._actor().stream.options(num_returns="streaming").remote(request)
        try:
            with self._errors():
                async for ref in refs:
                    yield await ref
        finally:
            _cancel(refs)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        wire = tuple(_to_wire(a) for a in args), {k: _to_wire(v) for k, v in kwargs.items()}
        return await self._await(self._actor().call.remote(method, *wire))

    async def alive(self) -> bool:
        if self.actor is None:
            return False
        try:
            ok, _ = await self._await(self.actor.alive.remote(), PING_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - any failure to answer is death here
            self.unresponsive = True
            return False
        return bool(ok)

    async def pid(self) -> int:
        return await self._await(self._actor().pid.remote())

    async def stop(self) -> None:
        import ray

        actor, self.actor = self.actor, None
        unresponsive, self.unresponsive = self.unresponsive, False
        if actor is None:
            return
        if not unresponsive:  # one that missed its ping would only hold its restart longer
            try:
                await asyncio.wait_for(actor.shutdown.remote(), STOP_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - dead or stuck: killed below either way
                pass
        ray.kill(actor, no_restart=True)

    def _actor(self) -> Any:
        if self.actor is None:
            raise ReplicaDead(f"{self.name} is not running")
        return self.actor

    async def _await(self, ref: Any, timeout: float | None = None) -> Any:
        """The ref's value, with Ray's wrappers taken off its errors."""
        try:
            with self._errors():
                return await asyncio.wait_for(ref, timeout) if timeout else await ref
        except asyncio.CancelledError:
            _cancel(ref)
            raise
        except asyncio.TimeoutError:
            raise ReplicaDead(f"{self.name} did not answer within {timeout:.0f} s") from None

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """A dead actor or engine as ReplicaDead; an engine's refusal as its own exception."""
        import ray

        try:
            yield
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise ReplicaDead(f"{self.name} died: {_first_line(e)}") from None
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if e.cause is not None else RuntimeError(_first_line(e))
            if isinstance(cause, EngineDeadError):
                raise ReplicaDead(f"{self.name}'s engine stopped: {cause}") from None
            raise cause from None


def _cancel(ref: Any) -> None:
    import ray

    try:
        ray.cancel(ref)
    except Exception:  # noqa: BLE001 - already finished, or its actor is gone
        pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
