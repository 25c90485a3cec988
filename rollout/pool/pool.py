"""RolloutPool: N engine replicas behind the RolloutEngine API.

    pool = RolloutPool("/path/to/ckpt", replicas=4, dtype="bfloat16")   # Ray actors
    outs = pool.generate(input_ids=prompts, sampling_params={"n": 8, ...})
    pool.update_weights_from_disk(...)                # every replica, all or nothing

Every method of RolloutEngine is here with the same arguments and answers: generation is
split per prompt and routed (router.py), weight, version, pause and memory calls fan out to
every replica (weights.py), get_server_info sums the replicas' and adds each one's state and
routing counters. A replica that dies is restarted and brought to the pool's weights before
it takes traffic again (supervisor.py); its requests are retried once elsewhere (dispatch.py).

The replicas are Ray actors (`RolloutPool(model_path, replicas=N, ...)`, ray_setup.py) or
`rollout serve` workers (`RolloutPool.over_workers(urls)`, which `rollout router` serves). As
RolloutEngine does, the pool runs its own event loop on a thread, so the sync methods work
anywhere and the async ones from any loop.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from rollout.config import EngineOptions
from rollout.control import ControlCall, control_method
from rollout.control_api import ControlAPI
from rollout.engine import loop_streams
from rollout.engine.loop_calls import await_on, call_on, on_loop
from rollout.engine.worker_calls import run_in
from rollout.errors import InvalidRequest
from rollout.generate_request import GenerateRequest, takes_generate_request
from rollout.pool import pool_setup
from rollout.pool.adapters import PoolAdapters
from rollout.pool.dispatch import Dispatcher
from rollout.pool.pool_calls import PoolCalls
from rollout.pool.replica import Replica
from rollout.pool.supervisor import FAILED, Supervisor
from rollout.pool.weight_source import Named
from rollout.pool.weights import PoolWeights
from rollout.weight_sync import calls
from rollout.weight_sync.flat_bucket import FlatBucket
from rollout.weight_sync.tensor_handles import TensorHandles


class RolloutPool(ControlAPI):
    def __init__(
        self, model_path: str, replicas: int = 2, *, ray_address: str | None = None,
        ray_init: dict[str, Any] | None = None, num_cpus_per_replica: float = 1,
        num_gpus_per_replica: float | None = None, placement_strategy: str = "SPREAD",
        runtime_env: dict | None = None, pool_options: pool_setup.PoolOptions | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        **engine_options: Any,
    ) -> None:  # fmt: skip
        """`replicas` RolloutEngines of `model_path` (each with `engine_options`, as
        RolloutEngine takes them) as Ray actors: on the cluster at `ray_address` ("auto": this
        node's), or a local cluster started with `ray_init` (ray.init's arguments). Each
        replica takes `num_cpus_per_replica` CPUs and `num_gpus_per_replica` GPUs (default: one
        per tensor-parallel rank on a GPU; a fraction shares a GPU, with a mem_fraction to
        match). `loop_factory` makes the pool's event loop (default: asyncio's)."""
        from rollout.pool import ray_setup

        if not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        EngineOptions.from_kwargs(model_path=model_path, **engine_options)  # refused here, early
        ray_setup.check_placement(num_cpus_per_replica, num_gpus_per_replica, placement_strategy)
        self._ray_group, self._owns_ray = None, ray_setup.connect(ray_address, ray_init)
        try:
            self._ray_group, made = ray_setup.place_replicas(
                model_path, replicas, engine_options, num_cpus_per_replica,
                num_gpus_per_replica, placement_strategy, runtime_env,
            )  # fmt: skip
            self._open(made, model_path, engine_options, pool_options, loop_factory)
        except BaseException:
            ray_setup.remove(self._ray_group, self._owns_ray)
            raise

    @classmethod
    def over_workers(
        cls, worker_urls: list[str], api_key: str | None = None, model_path: str | None = None,
        pool_options: pool_setup.PoolOptions | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> RolloutPool:  # fmt: skip
        """A pool over running `rollout serve` workers (api_key: their admin key, if any).
        `model_path` (default: the workers') is read here for the tokenizer only.
        `loop_factory` makes the pool's event loop (default: asyncio's)."""
        from rollout.pool.http_replica import HttpReplica, check_worker_urls

        check_worker_urls(worker_urls)
        pool = cls.__new__(cls)
        pool._ray_group, pool._owns_ray = None, False
        made = [HttpReplica(i, url, api_key) for i, url in enumerate(worker_urls)]
        pool._open(made, model_path, {}, pool_options, loop_factory)
        return pool

    def _open(
        self, replicas: list[Replica], model_path: str | None, engine_options: dict[str, Any],
        pool_options: pool_setup.PoolOptions | None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
    ) -> None:  # fmt: skip
        self.pool_options = opts = pool_options or pool_setup.PoolOptions()
        self._closed = False
        self._loop = (loop_factory or asyncio.new_event_loop)()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rollout-pool", daemon=True
        )
        self._thread.start()
        self._workers = ThreadPoolExecutor(
            min(4, os.cpu_count() or 1), thread_name_prefix="rollout-pool"
        )
        try:
            self.router = opts.make_router(len(replicas))
            self.supervisor = Supervisor(
                replicas, self.router, opts.health_check_s, opts.max_restarts
            )
            infos = self._call(self.supervisor.start_all())
            model_path = model_path or infos[0]["model_path"]
            setup = pool_setup.describe(model_path, engine_options, infos[0])
            self.options, self.info, self.tokenizer, self.limits = setup
            self.is_classifier = pool_setup.is_classifier(model_path)
            self.source = opts.make_source(infos[0])
            adapter_sources = opts.make_adapter_sources(infos[0])
            self.weights = PoolWeights(self.supervisor, self.source, adapter_sources)
            self.adapters = PoolAdapters(self.supervisor, self.weights)
            self.supervisor.restore = self._restore
            self.dispatcher = Dispatcher(self.supervisor, self.router, opts.wait_for_replica_s)
            self.calls = PoolCalls(self.supervisor, self.dispatcher, self.weights, self.adapters)
        except BaseException:
            self.shutdown()
            raise

    # ---- generation -------------------------------------------------------------------------
    @takes_generate_request
    def generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        """As RolloutEngine.generate; a batch is spread over the replicas, one prompt each."""
        self._check_open()
        if request.stream:
            return loop_streams.to_thread(self._loop, lambda: self.dispatcher.stream(request))
        return self._call(self.dispatcher.generate(request))

    @takes_generate_request
    async def async_generate(
        self, request: GenerateRequest
    ) -> dict | list[dict] | AsyncIterator[dict]:
        self._check_open()
        if request.stream:
            if self._on_loop():
                return self.dispatcher.stream(request)
            return loop_streams.to_loop(self._loop, lambda: self.dispatcher.stream(request))
        return await self._await(self.dispatcher.generate(request))

    @takes_generate_request
    def validate_generate(self, request: GenerateRequest) -> None:
        """Raises what generate would for these arguments, checked here as one engine would."""
        from rollout.engine.request_validation import build_inputs

        build_inputs(self.tokenizer, self.limits, replace(request, stream=False))

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await run_in(self._workers, fn, *args, **kwargs)

    async def _restore(self, i: int) -> None:
        """A restarted replica i gets the pool's weights and version, then its adapters with
        their current values (weights.py, adapter_source.py)."""
        await self.weights.restore(i)

    # ---- sessions: each on one replica, where its turns' KV stays --------------------------
    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """As RolloutEngine.open_session; the session's turns all run on the replica that
        opened it (a turn whose replica died fails: its earlier turns are gone with it)."""
        self._check_open()
        return self._call(self.dispatcher.open_session(capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> None:
        self._check_open()
        self._call(self.dispatcher.close_session(session_id))

    # ---- embeddings, rewards and label scores: one replica each (the least loaded) ---------
    def encode(
        self, prompt: Any = None, input_ids: Any = None, normalize: bool = False, rid: Any = None
    ) -> Any:
        return self._one("encode", prompt, input_ids, normalize, rid)

    async def async_encode(
        self, prompt: Any = None, input_ids: Any = None, normalize: bool = False, rid: Any = None
    ) -> Any:
        return await self._await(
            self.dispatcher.call_one("encode", prompt, input_ids, normalize, rid)
        )

    def classify(
        self, prompt: Any = None, input_ids: Any = None, messages: Any = None, rid: Any = None
    ) -> Any:
        return self._one("classify", prompt, input_ids, messages, rid)

    async def async_classify(
        self, prompt: Any = None, input_ids: Any = None, messages: Any = None, rid: Any = None
    ) -> Any:
        return await self._await(
            self.dispatcher.call_one("classify", prompt, input_ids, messages, rid)
        )

    def score(self, *args: Any, **kwargs: Any) -> list[list[float]]:
        return self._one("score", *args, **kwargs)

    async def async_score(self, *args: Any, **kwargs: Any) -> list[list[float]]:
        return await self._await(self.dispatcher.call_one("score", *args, **kwargs))

    def _one(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        return self._call(self.dispatcher.call_one(method, *args, **kwargs))

    # ---- weights: every replica, all or nothing (weights.py) ----------------------------------
    def update_weights_from_tensor(
        self, named_tensors: calls.NamedTensors, load_format: str | None = None,
        flush_cache: bool = True, weight_version: str | None = None,
        lora_name: str | None = None, abort_all_requests: bool = False,
    ) -> dict:  # fmt: skip
        """Shares the tensors once (CUDA IPC or shared memory: the replicas must be on this
        node) and has every replica load them (with lora_name: new values of that adapter).
        The pool keeps a CPU copy (see weight_source.py, adapter_source.py) unless
        keep_tensor_snapshot=False. SGLang's serialized payloads go to single engines only."""
        self._check_open()
        snapshot = (
            None if isinstance(named_tensors, TensorHandles) else (lambda: _pairs(named_tensors))
        )
        args = named_tensors, load_format, flush_cache, weight_version
        with calls.UpdateWeightsFromTensor.shared(*args) as call:
            if call.tensor_handles is None:
                raise InvalidRequest(
                    "serialized_named_tensors are not supported through a pool: give tensors "
                    "or TensorHandles"
                )
            kwargs = {"load_format": load_format, "flush_cache": flush_cache}
            if lora_name is not None:
                kwargs["lora_name"] = lora_name
            if abort_all_requests:
                kwargs["abort_all_requests"] = True
            method = call.method
            return self._call(
                self.weights.update(
                    method, (call.tensor_handles,), kwargs, weight_version, snapshot
                )
            )

    # allowed_roots: every file read must resolve under one of these (else PermissionError).
    update_weights_from_disk = control_method(calls.UpdateWeightsFromDisk)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """Replica 0's (or the least loaded's) weight: every replica holds the same."""
        return self.control(calls.GetWeightsByName(name, truncate_size))["values"]

    def get_weight_version(self) -> str:
        return self.source.version

    def control(self, call: ControlCall) -> Any:
        """Runs `call` on the pool: fanned out (weights, versions, pause, memory, cache) or on
        one replica (reads)."""
        self._check_open()
        return self._call(self.calls.run(call))

    # ---- control ----------------------------------------------------------------------------
    def flush_cache(self) -> dict:
        """success only when every replica flushed (none does while requests run)."""
        self._check_open()
        return self._call(self.calls.flush())

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        """To the replica the rid was routed to (or every one, for abort_all)."""
        self._check_open()
        self._call(self.dispatcher.abort(rid, abort_all))

    def get_server_info(self) -> dict:
        self._check_open()
        return self._call(self.calls.server_info())

    def stats(self) -> dict:
        """Each replica's state and routing counters (prefix hits, retries, restarts)."""
        return {
            "replicas": [
                {**state, **route}
                for state, route in zip(self.supervisor.info(), self.router.stats())
            ],
            "weight_version": self.source.version,
        }

    def replica_call(self, replica: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs one engine method on one replica, bypassing the pool (inspection, repair)."""
        self._check_open()
        return self._call(self.supervisor.replicas[replica].call(method, *args, **kwargs))

    @property
    def replicas(self) -> list[Replica]:
        return list(self.supervisor.replicas)

    # ---- life -------------------------------------------------------------------------------
    def is_alive(self) -> bool:
        """True while the pool is open and some replica serves or is coming back."""
        sup = getattr(self, "supervisor", None)
        return not self._closed and sup is not None and any(s != FAILED for s in sup.state)

    @property
    def dead_reason(self) -> str | None:
        if self._closed:
            return "the pool is shut down"
        return None if self.is_alive() else f"every replica failed: {self.supervisor.describe()}"

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the pool is shut down")

    def run_on_loop(self, coro: Any) -> Any:
        """Runs `coro` on the pool's event loop and waits for it (rollout router serves HTTP
        there: its requests then reach the pool with no hop between threads)."""
        return self._call(coro)

    def _on_loop(self) -> bool:
        return on_loop(self._loop)

    def _call(self, coro: Any) -> Any:
        return call_on(self._loop, coro, "RolloutPool")

    async def _await(self, coro: Any) -> Any:
        return await await_on(self._loop, coro)

    def shutdown(self) -> None:
        """Stops every replica (and the local Ray cluster, if the pool started it). Idempotent."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        sup = getattr(self, "supervisor", None)
        if sup is not None:
            try:
                asyncio.run_coroutine_threadsafe(sup.stop(), self._loop).result(timeout=60)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        self._workers.shutdown(wait=False, cancel_futures=True)
        # What still runs on the loop (a start interrupted by a signal, a request's task) is
        # cancelled and awaited, not left pending in a stopped loop.
        try:
            asyncio.run_coroutine_threadsafe(_cancel_pending(), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - shutting down regardless
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if self._ray_group is not None or self._owns_ray:
            from rollout.pool import ray_setup

            ray_setup.remove(self._ray_group, self._owns_ray)
            self._ray_group, self._owns_ray = None, False

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


async def _cancel_pending() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _pairs(named: Any) -> Named:
    """The (name, tensor) pairs of what update_weights_from_tensor takes."""
    if isinstance(named, FlatBucket):
        return named.views()
    if isinstance(named, dict):
        return list(named.items())
    if named and all(isinstance(b, FlatBucket) for b in named):
        return [pair for bucket in named for pair in bucket.views()]
    return list(named)
