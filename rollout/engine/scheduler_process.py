"""The scheduler's process: receive requests and control calls, step, send outputs.

An exception that one request explains fails that request alone (the Scheduler handles it);
any other ends the process after a SchedulerFailed message, so the caller raises it instead
of waiting forever.
"""

from __future__ import annotations

import logging
import pickle
import time
import traceback
from typing import Any

import zmq

from rollout.config import EngineOptions
from rollout.control import ControlCall
from rollout.engine.control_calls import (
    CALLS,
    READ_ONLY_CALLS,
    FlushCache,
    GetServerInfo,
    Shutdown,
)
from rollout.engine.heap import startup_heap_frozen
from rollout.engine.kernel_compiles import process_compiles
from rollout.engine.lora_calls import LORA_CALLS
from rollout.engine.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    ReqOutputBatch,
    SchedulerFailed,
    SchedulerReady,
    TokenizedRequest,
    is_control,
)
from rollout.engine.model_runner import ModelRunner
from rollout.engine.processes import Addresses, watch_parent
from rollout.engine.tp_follower import Follower, rank_memory
from rollout.engine.tp_setup import OtherRanks, join_group
from rollout.engine.warm_up import warm_up
from rollout.engine.weight_sync_port import RanksPort, RunnerPort
from rollout.errors import ControlError
from rollout.forward.tensor_parallel import SINGLE, TPGroup
from rollout.weight_sync.adapter_ranks import RankAdapters
from rollout.weight_sync.adapter_update import AdapterUpdates
from rollout.weight_sync.deferred import Deferred
from rollout.weight_sync.rank_weights import RankWeights

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
DEFERRED_POLL_MS = 10  # while a deferred control call waits: how soon its reply goes out


def load_eos_token_ids(model_path: str, hf_config: Any, tokenizer: Any) -> list[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, together."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None), tokenizer.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:
        pass  # no generation_config.json
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return sorted(ids)


def build_runner(options: EngineOptions, tp: TPGroup) -> tuple[ModelRunner, Any, list[int]]:
    """This rank's model runner, the tokenizer and the EOS ids."""
    from transformers import AutoConfig, AutoTokenizer

    mopts = options.model
    hf_config = AutoConfig.from_pretrained(mopts.model_path)
    tokenizer = AutoTokenizer.from_pretrained(mopts.tokenizer_path or mopts.model_path)
    eos = load_eos_token_ids(mopts.model_path, hf_config, tokenizer)
    context = mopts.context_length or getattr(hf_config, "max_position_embeddings", 4096)
    return ModelRunner(options, hf_config, context, eos, tp), tokenizer, eos


class SchedulerProcess:
    def __init__(self, options: EngineOptions, tp: TPGroup = SINGLE) -> None:
        from rollout.engine.scheduler import Scheduler
        from rollout.engine.stop_checker import StopChecker
        from rollout.engine.weight_sync_port import SchedulerPort
        from rollout.weight_sync.controller import WeightSyncController

        mopts = options.model
        process_compiles.install()  # before the graphs' capture compiles
        self.runner, tokenizer, eos = build_runner(options, tp)
        self.options = options = self.runner.options  # resolved for the KV pool
        hf_config = self.runner.hf_config
        self.scheduler = Scheduler(options, self.runner, StopChecker(tokenizer, eos))
        port = SchedulerPort(self.scheduler, self.runner)
        self.weight_sync = WeightSyncController(port, options.weight_sync)
        self.deferred: list[tuple[int, Deferred]] = []  # (call_id, its pending reply)
        self.ranks: OtherRanks | None = None  # set by the caller when tp > 1
        # The other ranks' rank_memory, asked again after a call that may change it: asking
        # waits for their step in flight.
        self.other_ranks_memory: list[dict] | None = None
        self.info = {
            "model_path": mopts.model_path,
            "architecture": (hf_config.architectures or ["?"])[0],
            "vocab_size": self.runner.vocab_size,
            "context_length": self.runner.context_length,
            "max_total_tokens": self.runner.num_slots,
            "max_running_requests": options.scheduler.max_running_requests,
            "eos_token_ids": eos,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "attention_backend": self.runner.kernel_plan.attention_backend,
            "decode_attention": str(self.runner.kernel_plan.decode_attention),
            "kernel_plan": self.runner.kernel_plan.as_dict(),
            "tp_size": tp.size,
        }
        # At WARNING, the level this process logs at: the one start-up line worth seeing.
        logger.warning("kernel plan: %s", self.runner.kernel_plan)

    def warm_up(self) -> None:
        """Runs the warm-up (warm_up.py) before the engine reports ready. A warm-up that fails
        is logged and skipped: the engine serves without it, its first requests compiling."""
        start = time.perf_counter()
        try:
            warm_up(self.options, self.runner, self.scheduler.stop_checker)
        except Exception:  # noqa: BLE001 - a warm-up is an optimization, never a reason to fail
            logger.exception("the warm-up failed; serving without it")
            return
        self.info["warmup_s"] = round(time.perf_counter() - start, 3)

    def handle(self, msg: TokenizedRequest) -> None:
        """A pickled message: request traffic (control traffic comes as ControlRequest)."""
        if not isinstance(msg, TokenizedRequest):
            raise TypeError(f"scheduler got an unknown message {type(msg).__name__}")
        self.scheduler.add_request(msg)

    def control(self, request: ControlRequest) -> ControlReply | None:
        """Runs one call; its reply, or None (an abort needs none; a deferred call is replied
        to by the loop once done)."""
        call = request.call
        if isinstance(call, AbortRequest):
            self.scheduler.abort(call)
            return None
        if isinstance(call, Shutdown):
            return ControlReply(request.call_id, last=True)
        try:
            result = self._run(call)
            if isinstance(result, Deferred):
                self.deferred.append((request.call_id, result))
                return None
        except Exception as e:  # noqa: BLE001 - every failure must reach the caller
            return self._failed(request.call_id, call.method, e)
        return ControlReply(request.call_id, result)

    def _run(self, call: ControlCall) -> dict | Deferred:
        if isinstance(call, FlushCache):
            return self.scheduler.flush_cache()
        if isinstance(call, LORA_CALLS):
            return self.scheduler.lora_call(call)
        if isinstance(call, GetServerInfo):
            if self.ranks is not None and self.other_ranks_memory is None:
                self.other_ranks_memory = [r.result for r in self.ranks.call("rank_memory")]
            ranks = [rank_memory(self.runner), *(self.other_ranks_memory or ())]
            info = {**self.info, **self.scheduler.server_info(), **self.weight_sync.info()}
            return {**info, **process_compiles.info(), "ranks": ranks}
        return self.weight_sync.run(call)

    @staticmethod
    def _failed(call_id: int, method: str, error: Exception) -> ControlReply:
        reply = ControlReply(call_id, error=ControlError.of(error))
        if reply.error.kind == "internal":  # a bug: the caller gets its name, the log its trace
            logger.error("control call %s failed", method, exc_info=error)
        return reply

    def _receive_control(self, frames: list[bytes], send: zmq.Socket) -> ControlReply | None:
        try:
            request = ControlRequest.from_frames(frames, CALLS)
        except Exception as e:  # noqa: BLE001 - built and checked by the engine: a bug here
            call_id = ControlRequest.id_of(frames)
            if call_id is None:
                raise
            return self._failed(call_id, "reading a control call", e)
        if isinstance(request.call, READ_ONLY_CALLS):
            # Answered from the state between steps; the step in flight runs on, unless it is
            # the last (applying it then stalls nothing, and the caller sees the engine idle).
            settle = not self.scheduler.has_requests()
        else:
            # A control call sees no batch in flight, and that batch's outputs leave first:
            # stamped with the weight version that computed them.
            settle = not isinstance(request.call, AbortRequest)
            self.other_ranks_memory = None
        if settle:
            self.scheduler.drain()
            self._send_outputs(send, self.scheduler.take_reports())
        return self.control(request)

    def loop(self, recv: zmq.Socket, send: zmq.Socket) -> None:
        while True:
            if not self.scheduler.can_step():
                recv.poll(DEFERRED_POLL_MS if self.deferred else IDLE_POLL_MS)
            self._finish_deferred(send)
            replies: list[ControlReply] = []
            while recv.poll(0):
                frames = recv.recv_multipart()
                if is_control(frames):
                    reply = self._receive_control(frames, send)
                    if reply is not None:
                        replies.append(reply)
                else:
                    self.handle(pickle.loads(frames[0]))
            last = [r for r in replies if r.last]
            self._send_outputs(send, self.scheduler.step())
            for reply in replies:
                if not reply.last:
                    self._reply(send, reply)
            if last:
                self._reply(send, last[0])
                return

    def _finish_deferred(self, send: zmq.Socket) -> None:
        """Replies to the deferred calls whose wait has ended, in the order the calls came. Each
        finishes here, on the loop's thread, with no batch in flight (it may change weights),
        and its reply leaves at once: the next may wait on a peer that waits for this reply."""
        waiting = []
        for call_id, deferred in self.deferred:
            if not deferred.done():
                waiting.append((call_id, deferred))
                continue
            self.scheduler.drain()
            self._send_outputs(send, self.scheduler.take_reports())
            self.other_ranks_memory = None
            try:
                result = deferred.finish()
            except Exception as e:  # noqa: BLE001 - every failure must reach the caller
                self._reply(send, self._failed(call_id, "a deferred call", e))
                continue
            if isinstance(result, Deferred):
                waiting.append((call_id, result))
            else:
                self._reply(send, ControlReply(call_id, result))
        self.deferred = waiting

    def _reply(self, send: zmq.Socket, reply: ControlReply) -> None:
        try:
            frames = reply.to_frames()
        except (TypeError, ValueError) as e:  # a result that is no JSON: a bug of the call's
            frames = self._failed(reply.call_id, "encoding a reply", e).to_frames()
        send.send_multipart(frames)

    def _send_outputs(self, send: zmq.Socket, done: list) -> None:
        if done:
            # A request may appear twice (streamed, then aborted): report it once.
            unique = list({id(r): r for r in done}.values())
            send.send_pyobj(ReqOutputBatch([self.scheduler.make_output(r) for r in unique]))


def run_scheduler_process(
    options: EngineOptions, addrs: Addresses, parent_pid: int, rank: int = 0
) -> None:
    """Tensor-parallel rank `rank`'s process: rank 0 schedules, the others follow it."""
    watch_parent(parent_pid)
    name = "scheduler" if rank == 0 else f"tp rank {rank}"
    logging.basicConfig(level=logging.WARNING, format=f"[{name}] %(levelname)s %(message)s")
    ctx = zmq.Context()
    if rank > 0:
        _follow(ctx, options, addrs, rank)
        ctx.term()
        return
    recv = ctx.socket(zmq.PULL)
    recv.bind(addrs.scheduler)
    send = ctx.socket(zmq.PUSH)
    send.connect(addrs.detokenizer)
    proc = None
    try:
        options, tp = join_group(options, addrs, 0)
        proc = SchedulerProcess(options, tp)
        if tp.size > 1:
            proc.ranks = OtherRanks(ctx, addrs, proc.runner)
            proc.weight_sync.use_other_ranks(RanksPort(proc.ranks))
            if proc.runner.lora is not None:  # adapters load on every rank, or on none
                proc.runner.lora.use_other_ranks(RanksPort(proc.ranks))
        if proc.runner.device.type == "cuda" and not options.scheduler.skip_server_warmup:
            proc.warm_up()
        send.send_pyobj(SchedulerReady(proc.info))
        with startup_heap_frozen():
            proc.loop(recv, send)
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        send.send_pyobj(SchedulerFailed(traceback.format_exc()))
    finally:
        if proc is not None and proc.ranks is not None:
            proc.ranks.stop()
            proc.ranks.close()
        send.close(linger=2000)
        recv.close(linger=0)
        ctx.term()


def _follow(ctx: zmq.Context, options: EngineOptions, addrs: Addresses, rank: int) -> None:
    """A rank other than 0: runs rank 0's steps until it stops. A failure is reported through
    the detokenizer (which passes it to the caller, who shuts the engine down)."""
    report = ctx.socket(zmq.PUSH)
    report.connect(addrs.detokenizer)
    recv = ctx.socket(zmq.PULL)
    recv.connect(addrs.tp_steps[rank - 1])
    replies = ctx.socket(zmq.PUSH)
    replies.connect(addrs.tp_replies)
    try:
        options, tp = join_group(options, addrs, rank)
        runner, _, _ = build_runner(options, tp)
        weights = RankWeights(RunnerPort(runner), options.weight_sync, CALLS, tp.rank, tp.size)
        updates = AdapterUpdates(RunnerPort(runner), lambda: weights.local)
        adapters = RankAdapters(updates, CALLS, tp.rank)
        handlers = {
            "rank_memory": lambda: rank_memory(runner),
            **weights.handlers(),
            **adapters.handlers(),
        }
        with startup_heap_frozen():
            Follower(runner, handlers).run(recv, replies)
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        report.send_pyobj(
            SchedulerFailed(f"tensor-parallel rank {rank} failed:\n{traceback.format_exc()}")
        )
    finally:
        for sock in (report, recv, replies):
            sock.close(linger=1000)
