"""RolloutEngine: the in-process entry point.

It starts the scheduler and detokenizer subprocesses and runs the TokenizerManager on an
event loop of its own, in a background thread, so the synchronous API works anywhere (also
inside Jupyter or another event loop) and `async_generate` works from any loop; `rollout
serve` runs its HTTP server on that loop (run_on_loop), where a request reaches the
TokenizerManager with no hop between threads. The async
calls tokenize and render chat templates on worker threads of the engine, never on the
caller's loop (a server's loop must keep answering while a long prompt is tokenized).
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from rollout.config import EngineOptions, check_model_path
from rollout.control import ControlCall, control_method
from rollout.control_api import ControlAPI
from rollout.engine import embedding_requests, indexed_streams, loop_streams
from rollout.engine.control_calls import FlushCache, GetServerInfo
from rollout.engine.loop_calls import await_on, call_on, on_loop, refuse_on_loop
from rollout.engine.messages import AbortRequest, TokenizedRequest
from rollout.engine.processes import Addresses, start_process, stop_process
from rollout.engine.request_limits import RequestLimits
from rollout.engine.request_validation import build_inputs
from rollout.engine.session_params import with_session
from rollout.engine.worker_calls import run_in
from rollout.errors import InvalidRequest
from rollout.generate_request import GenerateRequest, takes_generate_request
from rollout.weight_sync import calls
from rollout.weight_sync.results import sglang_shaped

# HF fast tokenizers release the GIL while they encode: a few threads tokenize in parallel.
TOKENIZE_THREADS = min(4, os.cpu_count() or 1)


class RolloutEngine(ControlAPI):
    def __init__(
        self, model_path: str,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None, **options: Any,
    ) -> None:  # fmt: skip
        """`options`: EngineOptions' fields (rollout/config.py); `loop_factory` makes the
        engine's event loop (default: asyncio's; rollout serve passes uvicorn's choice)."""
        check_model_path(model_path)
        self.options = EngineOptions.from_kwargs(model_path=model_path, **options)
        embedding_requests.check_embedding_mode(model_path, self.options.model.is_embedding)
        self.is_classifier = embedding_requests.is_classifier_checkpoint(model_path)
        from transformers import AutoTokenizer

        from rollout.engine.detokenizer import run_detokenizer_process
        from rollout.engine.scheduler_process import run_scheduler_process
        from rollout.engine.tokenizer_manager import TokenizerManager

        tok_path = self.options.model.tokenizer_path or model_path
        self.tokenizer = AutoTokenizer.from_pretrained(tok_path)
        self._addrs = Addresses.fresh(self.options.parallel.tp_size)
        self._procs = []
        self._loop = (loop_factory or asyncio.new_event_loop)()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rollout-tm", daemon=True
        )
        self._thread.start()
        self._workers = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="rollout-tokenize")
        self._closed = False
        # An engine left open at interpreter exit is shut down first (atexit runs the latest
        # hook first): its children ignore SIGTERM (start_process), so multiprocessing's own
        # exit hook, which terminates and then joins them, would wait for them forever.
        self._at_exit = functools.partial(_shutdown_if_open, weakref.ref(self))
        atexit.register(self._at_exit)
        try:
            self._tm = self._call(self._make_tm(TokenizerManager))
            pid = os.getpid()
            for rank in range(self.options.parallel.tp_size):  # rank 0 schedules: tp_steps.py
                name = "rollout-scheduler" if rank == 0 else f"rollout-tp-rank-{rank}"
                args = (self.options, self._addrs, pid, rank)
                self._procs.append(start_process(run_scheduler_process, args, name))
            self._procs.append(
                start_process(
                    run_detokenizer_process, (tok_path, self._addrs, pid), "rollout-detokenizer"
                )
            )
            self.info = self._call(self._tm.start())
            self.limits = RequestLimits(self.info["context_length"], self.options.requests)
        except BaseException:
            self.shutdown()
            raise

    async def _make_tm(self, cls: Any) -> Any:
        # Created on the engine's loop: its zmq.asyncio sockets belong to that loop.
        alive = lambda: all(p.is_alive() for p in self._procs)  # noqa: E731
        return cls(self.tokenizer, self._addrs, self.options.model.random_seed, alive)

    def _call(self, coro: Any) -> Any:
        return call_on(self._loop, coro, "RolloutEngine")

    def run_on_loop(self, coro: Any) -> Any:
        """Runs `coro` on the engine's event loop and waits for it (rollout serve serves HTTP
        there: its requests then reach the engine with no hop between threads)."""
        return self._call(coro)

    async def run_in_worker(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Awaits fn(*args, **kwargs) run on the engine's tokenizer threads: CPU work on a
        request (tokenizing, chat templates) that must not hold the caller's event loop."""
        return await run_in(self._workers, fn, *args, **kwargs)

    # ---- generation -----------------------------------------------------------------------
    # The arguments are GenerateRequest's fields (rollout/generate_request.py), or one
    # GenerateRequest.
    @takes_generate_request
    def generate(self, request: GenerateRequest) -> dict | list[dict] | Iterator[dict]:
        """One prompt gives a dict, a list (or n > 1) a list of dicts, stream=True an iterator."""
        inputs, batched = self._inputs(request)
        if request.stream and batched:  # every sample streamed, its outputs with an index
            return self._stream_sync(lambda: indexed_streams.merge(self._tm, inputs))
        if request.stream:
            return self._stream_sync(lambda: self._tm.generate(inputs[0]))
        results = self._run_requests(inputs)
        return results if batched else results[0]

    @takes_generate_request
    async def async_generate(
        self, request: GenerateRequest
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As generate, awaited; with stream=True, an async iterator. Cancelling aborts."""
        inputs, batched = await self.run_in_worker(self._inputs, request)
        if request.stream and batched:  # every sample streamed, its outputs with an index
            return self._stream_async(lambda: indexed_streams.merge(self._tm, inputs))
        if request.stream:
            return self._stream_async(lambda: self._tm.generate(inputs[0]))
        results = await await_on(self._loop, self._gather(inputs))
        return results if batched else results[0]

    @takes_generate_request
    def validate_generate(self, request: GenerateRequest) -> None:
        """Raises what generate would for these arguments (ValueError, TypeError) without
        running anything: for callers that split one request into several."""
        self._inputs(replace(request, stream=False))

    def _inputs(self, request: GenerateRequest) -> tuple[list[TokenizedRequest], bool]:
        self._check_open()
        if self.options.model.is_embedding:
            raise InvalidRequest(
                "this engine serves embeddings (is_embedding=True): use encode, classify or score, "
                "or start it without is_embedding to generate"
            )
        # Built as unstreamed, then marked: a batch or n > 1 streams each of its samples.
        inputs, batched = build_inputs(self.tokenizer, self.limits, replace(request, stream=False))
        if request.stream:
            inputs = [replace(inp, stream=True) for inp in inputs]
        if request.session_params is not None:
            from_text = request.prompt is not None
            inputs = with_session(self.tokenizer, request.session_params, from_text, inputs)
        return inputs, batched

    # ---- sessions (token in / token out multi-turn; see sessions.py) -----------------------
    def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """Opens a session; returns its id (session_id, or a fresh one). A request with
        session_params={"id": it, "rid": an earlier turn's rid} runs on that turn's prompt and
        output ids followed by its own input, reusing the turn's KV, which the session keeps
        cached until close_session. capacity_of_str_len: the most tokens a turn may hold."""
        self._check_open()
        return self._call(self._tm.open_session(capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> None:
        """Closes the session: its running turns are aborted and the KV it kept is unpinned.
        An id that is not open raises InvalidRequest."""
        self._check_open()
        self._call(self._tm.close_session(session_id))

    # ---- embeddings, rewards and label scores (see embedding_requests.py) -------------------
    def encode(
        self, prompt: Any = None, input_ids: Any = None, normalize: bool = False, rid: Any = None
    ) -> Any:
        """{"embedding": last-token final-norm hidden state (a classifier: its scores),
        "meta_info"} per prompt; a list in, a list out. Needs is_embedding=True."""
        return self._run(self._embed(prompt, input_ids, None, normalize, rid))

    async def async_encode(
        self, prompt: Any = None, input_ids: Any = None, normalize: bool = False, rid: Any = None
    ) -> Any:
        return await self._arun(self._embed, prompt, input_ids, None, normalize, rid)

    def classify(
        self, prompt: Any = None, input_ids: Any = None, messages: Any = None, rid: Any = None
    ) -> Any:
        """As encode; `messages` (a chat, or a list of chats) go through the chat template.
        With a reward model, "embedding" holds its num_labels scores."""
        return self._run(self._embed(prompt, input_ids, messages, False, rid))

    async def async_classify(
        self, prompt: Any = None, input_ids: Any = None, messages: Any = None, rid: Any = None
    ) -> Any:
        return await self._arun(self._embed, prompt, input_ids, messages, False, rid)

    def score(
        self, query: Any, items: Any, label_token_ids: list[int], apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:  # fmt: skip
        """Per item, the probabilities of label_token_ids right after query + item (a causal LM;
        see embedding_requests.score_inputs)."""
        return self._run(self._score(query, items, label_token_ids, apply_softmax, item_first))

    async def async_score(
        self, query: Any, items: Any, label_token_ids: list[int], apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:  # fmt: skip
        args = (query, items, label_token_ids, apply_softmax, item_first)
        return await self._arun(self._score, *args)

    def _embed(self, *args: Any) -> tuple[list[TokenizedRequest], embedding_requests.Finish]:
        self._check_open()
        if not self.options.model.is_embedding:
            raise InvalidRequest(
                "encode and classify need an engine started with is_embedding=True"
            )
        return embedding_requests.embed_inputs(self.tokenizer, self.limits, *args)

    def _score(self, *args: Any) -> tuple[list[TokenizedRequest], embedding_requests.Finish]:
        self._check_open()
        if self.is_classifier:
            raise InvalidRequest(
                "score needs a causal LM (label-token probabilities); this checkpoint is a "
                "classifier"
            )
        return embedding_requests.score_inputs(self.tokenizer, self.limits, *args)

    def _run(self, built: tuple[list[TokenizedRequest], embedding_requests.Finish]) -> Any:
        inputs, finish = built
        return finish(self._run_requests(inputs))

    async def _arun(self, build: Callable[..., Any], *args: Any) -> Any:
        inputs, finish = await self.run_in_worker(build, *args)
        return finish(await await_on(self._loop, self._gather(inputs)))

    def _run_requests(self, inputs: list[TokenizedRequest]) -> list[dict]:
        """The requests' outputs, waited for on the caller's thread. Whatever stops the wait (a
        KeyboardInterrupt) aborts the requests, as cancelling async_generate or leaving a
        stream does, instead of leaving them to run to their end in the engine."""
        refuse_on_loop(self._loop, "RolloutEngine")
        fut = asyncio.run_coroutine_threadsafe(self._gather(inputs), self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    async def _gather(self, inputs: list[TokenizedRequest]) -> list[dict]:
        async def one(inp: TokenizedRequest) -> dict:
            last = None
            async for out in self._tm.generate(inp):
                last = out
            return last

        tasks = [asyncio.ensure_future(one(inp)) for inp in inputs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            raise

    def _stream_sync(self, source: loop_streams.Source) -> Iterator[dict]:
        """`source()`'s outputs on the caller's thread (never the engine's loop's)."""
        refuse_on_loop(self._loop, "RolloutEngine")
        return loop_streams.to_thread(self._loop, source)

    def _stream_async(self, source: loop_streams.Source) -> AsyncIterator[dict]:
        """`source()`'s outputs on the caller's loop: directly where that is the engine's."""
        return source() if on_loop(self._loop) else loop_streams.to_loop(self._loop, source)

    # ---- weight sync (the rest are ControlAPI's, rollout/control_api.py) -------------------
    def update_weights_from_tensor(
        self, named_tensors: calls.NamedTensors, load_format: str | None = None,
        flush_cache: bool = True, weight_version: str | None = None,
        lora_name: str | None = None, abort_all_requests: bool = False,
    ) -> dict:  # fmt: skip
        """Loads tensors of this process (list of (name, tensor) or dict; FlatBucket(s) with
        load_format="flattened_bucket"), or TensorHandles, all or none. Only CUDA IPC handles
        or shared-memory names reach the scheduler; the tensors must not change until this returns.
        abort_all_requests: the requests in flight end (as aborted) before the update."""
        self._check_open()
        args = named_tensors, load_format, flush_cache, weight_version, lora_name
        with calls.UpdateWeightsFromTensor.shared(*args, abort_all_requests) as call:
            return self.control(call)

    # allowed_roots: every file read must resolve under one of these (else PermissionError).
    update_weights_from_disk = control_method(calls.UpdateWeightsFromDisk)

    # SGLang's return shapes: (success, message), (success, message, num_paused_requests) for
    # disk; the whole answer is the result's `.info`, also read by key (weight_sync/results.py).
    init_weights_update_group = sglang_shaped(ControlAPI.init_weights_update_group)
    destroy_weights_update_group = sglang_shaped(ControlAPI.destroy_weights_update_group)
    update_weights_from_distributed = sglang_shaped(ControlAPI.update_weights_from_distributed)
    update_weights_from_tensor = sglang_shaped(update_weights_from_tensor)
    update_weights_from_disk = sglang_shaped(update_weights_from_disk, paused_count=True)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """The first truncate_size rows of a weight (HF name), as float lists."""
        return self.control(calls.GetWeightsByName(name, truncate_size))["values"]

    def get_weight_version(self) -> str:
        return self.control(calls.GetWeightVersion())["weight_version"]

    # ---- control --------------------------------------------------------------------------
    def flush_cache(self) -> dict:
        return self.control(FlushCache())  # success False while requests run: nothing flushed

    def abort_request(self, rid: str | None = None, abort_all: bool = False) -> None:
        self.control(AbortRequest(rid, abort_all))

    def get_server_info(self) -> dict:
        return self.control(GetServerInfo())

    def control(self, call: ControlCall) -> Any:
        """Runs `call` in the scheduler, in order with the requests before it: its result, or
        its failure raised as the exception of its kind (see rollout/errors.py)."""
        self._check_open()
        return self._call(self._tm.control(call))

    def is_alive(self) -> bool:
        """True while the engine is open and its subprocesses serve (dead_reason is None)."""
        return getattr(self, "_tm", None) is not None and self.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine no longer serves, None while it does: shut down, or what the
        tokenizer manager found (e.g. the scheduler's error, whose trace it logged) and which
        subprocesses exited with what code."""
        if self._closed:
            return "the engine is shut down"
        tm = getattr(self, "_tm", None)
        reasons = [tm.dead.splitlines()[0]] if tm is not None and tm.dead else []
        exited = [p for p in self._procs if not p.is_alive()]
        reasons += [f"{p.name} exited with code {p.exitcode}" for p in exited]
        return "; ".join(reasons) or None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")

    def shutdown(self) -> None:
        """Stops the subprocesses and the background loop. Idempotent."""
        if self._closed:
            return
        # A dead engine's children have nothing left to finish, and no shutdown message reaches
        # them (the detokenizer would sit out the whole graceful wait): they are killed at once.
        grace_s = 0 if self.dead_reason is not None else 5
        self._closed = True
        atexit.unregister(self._at_exit)
        tm = getattr(self, "_tm", None)
        if tm is not None and self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(tm.shutdown(), self._loop).result(timeout=15)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        for proc in self._procs:
            stop_process(proc, timeout=grace_s)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._addrs.cleanup()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()


def _shutdown_if_open(ref: weakref.ref[RolloutEngine]) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
