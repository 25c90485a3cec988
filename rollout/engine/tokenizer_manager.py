"""TokenizerManager: lives in the caller's event loop. Validates and tokenizes requests, sends
them to the scheduler, and turns the detokenizer's outputs back into SGLang-shaped dicts.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
import zmq.asyncio

from rollout.control import ControlCall
from rollout.engine.control_calls import GetServerInfo, Shutdown
from rollout.engine.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    ReqOutput,
    ReqOutputBatch,
    SchedulerFailed,
    SchedulerReady,
    TokenizedRequest,
    is_control,
    public_error,
)
from rollout.engine.output_builder import LogprobEntries, build_output_on_loop
from rollout.engine.processes import Addresses
from rollout.engine.request_validation import validate_for_model
from rollout.engine.sampling_params import check_logit_bias
from rollout.engine.sessions import SessionBook
from rollout.engine.token_text import TokenText
from rollout.errors import InvalidRequest
from rollout.weight_sync.calls import (
    ContinueGeneration,
    DiscardStagedWeights,
    UpdateWeightsFromDisk,
    UpdateWeightVersion,
)

logger = logging.getLogger(__name__)

WATCHDOG_S = 1.0
# At shutdown: how long the requests in flight get to end with the error before the loop stops.
WAKE_TIMEOUT_S = 2.0


class EngineDeadError(RuntimeError):
    """The scheduler or detokenizer process failed; the engine can't serve any more. The message
    is short (no traceback, no file paths): why it died is in this process's log."""


class RequestFailedError(RuntimeError):
    """Serving this one request failed inside the engine (the message says in what step and
    with which error, without traceback or paths); the engine serves on. The scheduler's log
    has the trace."""


@dataclass
class ReqState:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)


class TokenizerManager:
    def __init__(
        self, tokenizer: Any, addrs: Addresses, random_seed: int, is_alive: Callable[[], bool]
    ) -> None:
        self.tokenizer = tokenizer
        self.text_of = TokenText(tokenizer)  # the text of logprob entries, for all requests
        self.is_alive = is_alive
        self.random_seed = random_seed
        self._seed_counter = itertools.count()
        self._call_ids = itertools.count()
        self.ctx = zmq.asyncio.Context()
        self.send = self.ctx.socket(zmq.PUSH)
        self.send.connect(addrs.scheduler)
        self.recv = self.ctx.socket(zmq.PULL)
        self.recv.bind(addrs.tokenizer_manager)
        self.states: dict[str, ReqState] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self.info: dict[str, Any] = {}
        self.dead: str | None = None
        self._staged_model_path: str | None = None
        self._loop_task: asyncio.Task | None = None
        self.sessions = SessionBook()

    async def start(self) -> dict[str, Any]:
        """Waits for the scheduler to load the model; raises its error if it fails."""
        while True:
            if await self.recv.poll(int(WATCHDOG_S * 1000)):
                msg = await self.recv.recv_pyobj()
                if isinstance(msg, SchedulerReady):
                    self.info = msg.info
                    self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop())
                    return self.info
                if isinstance(msg, SchedulerFailed):
                    raise EngineDeadError(f"the engine failed to start:\n{msg.error}")
            elif not self.is_alive():
                raise EngineDeadError(
                    "the engine's subprocess exited during startup (its output, if any, is above; "
                    "killed?). Its processes import the calling script first: a "
                    "script that creates the engine at its top level must do so under "
                    '`if __name__ == "__main__":`'
                )

    # ---- requests -------------------------------------------------------------------------
    def next_seed(self) -> int:
        return (self.random_seed * 1_000_003 + next(self._seed_counter)) & 0x7FFFFFFF

    async def generate(self, inp: TokenizedRequest) -> AsyncIterator[dict[str, Any]]:
        """Yields output dicts for one (already validated, single-sample) request: one at the end,
        or one per update when streaming. Cancelling the consumer aborts the request."""
        self._check_alive()
        validate_for_model(inp, self.info["vocab_size"], self.info["context_length"])
        check_logit_bias(inp.params, self.info["vocab_size"])
        rid = inp.rid or uuid.uuid4().hex
        if rid in self.states:
            raise InvalidRequest(f"rid {rid!r} is already in use by a running request")
        seed = inp.params.seed if inp.params.seed is not None else self.next_seed()
        treq = replace(inp, rid=rid, seed=seed)
        if treq.session_params is not None:  # the session's earlier tokens, then this turn's
            treq = self.sessions.begin_turn(treq, self.info["context_length"])
        state = self.states[rid] = ReqState()
        total: ReqOutput | None = None  # every output so far, extended into the first
        entries = LogprobEntries(self.text_of if treq.return_text_in_logprobs else None)
        finished = False
        try:
            await self.send.send_pyobj(treq)
            while not finished:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    raise item
                reason = item.finish_reason
                if reason is not None and reason.get("type") == "invalid_request":
                    raise InvalidRequest(reason.get("message", "invalid request"))
                if reason is not None and reason.get("type") == "error":
                    # Not `finished`: the abort sent below frees it where it still runs (a
                    # failure in the detokenizer leaves it running in the scheduler).
                    raise RequestFailedError(f"request {rid} failed: {reason.get('message')}")
                if total is None:
                    total = item
                else:
                    total.extend(item)
                finished = item.finish_reason is not None
                # A stream whose consumer fell behind gets the updates queued meanwhile as one:
                # each output repeats everything so far, so one per update would cost the
                # square of the tokens.
                if finished or (inp.stream and state.queue.empty()):
                    latency = time.monotonic() - state.created
                    yield await build_output_on_loop(total, treq, latency, entries)
        finally:
            self.states.pop(rid, None)
            if treq.session_params is not None:
                self.sessions.end_turn(treq, total.new_ids if finished and total else None)
            if not finished and self.dead is None:
                await self.control(AbortRequest(rid=rid))

    async def control(self, call: ControlCall) -> Any:
        """Runs a control call in the scheduler, in order with the requests sent before it:
        its result (plain data), or its failure raised as the exception of its kind (see
        rollout/errors.py). An abort is sent without waiting for a reply."""
        self._check_alive()
        if isinstance(call, AbortRequest):
            await self.send.send_multipart(ControlRequest(None, call).to_frames())
            return None
        call_id = next(self._call_ids)
        fut = self.calls[call_id] = asyncio.get_running_loop().create_future()
        await self.send.send_multipart(ControlRequest(call_id, call).to_frames())
        try:
            reply: ControlReply = await fut
        finally:
            self.calls.pop(call_id, None)
        if reply.error is not None:
            if call.method.startswith("update_weights"):
                self._staged_model_path = None  # a failed update rolls back what was staged
            raise reply.error.exception()
        self._follow_model_path(call, reply.result)
        return reply.result

    def _follow_model_path(self, call: ControlCall, result: Any) -> None:
        """`info["model_path"]` (what /get_model_info and get_server_info report, as SGLang
        does) names the checkpoint of the weights served: a disk update's, once it commits."""
        if isinstance(call, UpdateWeightsFromDisk) and call.lora_name is None:
            if isinstance(result, dict) and result.get("staged"):
                self._staged_model_path = call.model_path  # commits at continue_generation
            else:
                self.info["model_path"] = call.model_path
        elif isinstance(call, (ContinueGeneration, UpdateWeightVersion)):
            if self._staged_model_path is not None:
                self.info["model_path"] = self._staged_model_path
            self._staged_model_path = None
        elif isinstance(call, DiscardStagedWeights):
            self._staged_model_path = None
        elif isinstance(call, GetServerInfo) and isinstance(result, dict):
            result["open_sessions"] = len(self.sessions.sessions)
            if "model_path" in self.info:
                result["model_path"] = self.info["model_path"]

    async def open_session(self, capacity_of_str_len: int, session_id: str | None = None) -> str:
        """Opens a session (sessions.py); returns its id."""
        self._check_alive()
        return self.sessions.open(capacity_of_str_len, session_id)

    async def close_session(self, session_id: str) -> None:
        """Closes an open session: its running turns are aborted, the KV it kept is unpinned."""
        self.sessions.close(session_id)
        await self.control(AbortRequest(session_id=session_id))

    # ---- receiving ------------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while self.dead is None:
            if not await self.recv.poll(int(WATCHDOG_S * 1000)):
                if not self.is_alive():
                    self._fail(
                        "an engine subprocess exited unexpectedly",
                        "it sent no report: killed (out of memory?) or crashed in native code",
                    )
                continue
            frames = await self.recv.recv_multipart()
            if is_control(frames):
                reply = ControlReply.from_frames(frames)
                fut = self.calls.get(reply.call_id)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
                if reply.last:
                    return
                continue
            msg = pickle.loads(frames[0])
            if isinstance(msg, ReqOutputBatch):
                for out in msg.outputs:
                    self._deliver(out)
            elif isinstance(msg, SchedulerFailed):
                self._fail(f"the scheduler failed: {public_error(msg.error)}", msg.error)

    def _deliver(self, out: ReqOutput) -> None:
        state = self.states.get(out.rid)
        if state is not None:  # else: the consumer already left
            state.queue.put_nowait(out)

    def _fail(self, error: str, detail: str) -> None:
        """The engine is dead: `error` (short) goes to every caller from now on, `detail` (the
        scheduler's traceback) to the log."""
        logger.error("the engine stopped serving: %s\n%s", error, detail)
        self.dead = error
        self._wake_callers()

    def _wake_callers(self) -> None:
        """Every request and control call still waiting raises EngineDeadError(self.dead)."""
        for state in self.states.values():
            state.queue.put_nowait(EngineDeadError(self.dead))
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(self.dead))

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    async def shutdown(self) -> None:
        if self.dead is None and self._loop_task is not None and not self._loop_task.done():
            try:
                await asyncio.wait_for(self.control(Shutdown()), timeout=10)
            except (asyncio.TimeoutError, EngineDeadError, RuntimeError):
                pass
        self.dead = self.dead or "the engine was shut down"
        if self._loop_task is not None:
            self._loop_task.cancel()
        # Requests still in flight end with the error instead of waiting for outputs that will
        # never come; their callers (on other threads too) hear of it before the loop stops.
        self._wake_callers()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAKE_TIMEOUT_S
        while self.states and loop.time() < deadline:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.005)
        self.send.close(linger=0)
        self.recv.close(linger=0)
        self.ctx.term()
