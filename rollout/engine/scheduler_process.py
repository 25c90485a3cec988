"""The scheduler's process: receive requests and control calls, step, send outputs.

An exception that one request explains fails that request alone (the Scheduler handles it);
any other ends the process after a SchedulerFailed message, so the caller raises it instead
of waiting forever.
"""

from __future__ import annotations

import logging
import traceback
from typing import Any

import zmq

from rollout.config import EngineOptions
from rollout.engine.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    ReqOutputBatch,
    SchedulerFailed,
    SchedulerReady,
    TokenizedRequest,
)
from rollout.engine.processes import Addresses, watch_parent
from rollout.weight_sync.deferred import Deferred

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


class SchedulerProcess:
    def __init__(self, options: EngineOptions) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from rollout.engine.model_runner import ModelRunner
        from rollout.engine.scheduler import Scheduler
        from rollout.engine.stop_checker import StopChecker
        from rollout.weight_sync.controller import WeightSyncController

        mopts = options.model
        hf_config = AutoConfig.from_pretrained(mopts.model_path)
        tokenizer = AutoTokenizer.from_pretrained(mopts.tokenizer_path or mopts.model_path)
        eos = load_eos_token_ids(mopts.model_path, hf_config, tokenizer)
        context = mopts.context_length or getattr(hf_config, "max_position_embeddings", 4096)
        self.runner = ModelRunner(options, hf_config, context, eos)
        self.scheduler = Scheduler(options, self.runner, StopChecker(tokenizer, eos))
        self.weight_sync = WeightSyncController(self.runner, self.scheduler, options)
        self.deferred: list[tuple[int, Deferred]] = []  # (call_id, its pending reply)
        self.info = {
            "model_path": mopts.model_path,
            "architecture": (hf_config.architectures or ["?"])[0],
            "vocab_size": self.runner.vocab_size,
            "context_length": self.runner.context_length,
            "max_total_tokens": self.runner.num_slots,
            "eos_token_ids": eos,
            "device": str(self.runner.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(self.runner.kv_dtype).removeprefix("torch."),
            "attention_backend": self.runner.attention_backend,
            "decode_attention": str(self.runner.decode_attention),
        }

    def handle(self, msg: Any) -> ControlReply | None:
        if isinstance(msg, TokenizedRequest):
            self.scheduler.add_request(msg)
        elif isinstance(msg, AbortRequest):
            self.scheduler.abort(msg)
        elif isinstance(msg, ControlRequest):
            return self.control(msg)
        else:
            raise TypeError(f"scheduler got an unknown message {type(msg).__name__}")
        return None

    def control(self, msg: ControlRequest) -> ControlReply | None:
        s = self.scheduler
        if msg.method == "shutdown":
            return ControlReply(msg.call_id, "shutdown")
        methods = {
            "flush_cache": s.flush_cache,
            "get_server_info": lambda: {**self.info, **s.server_info(), **self.weight_sync.info()},
            **self.weight_sync.methods(),
        }
        if msg.method not in methods:
            return ControlReply(msg.call_id, error=f"unknown control method {msg.method!r}")
        try:
            result = methods[msg.method](**msg.kwargs)
        except (ValueError, TypeError, KeyError, RuntimeError) as e:
            return ControlReply(msg.call_id, error=f"{type(e).__name__}: {e}")
        if isinstance(result, Deferred):
            self.deferred.append((msg.call_id, result))  # replied to by the loop, once done
            return None
        return ControlReply(msg.call_id, result)

    def loop(self, recv: zmq.Socket, send: zmq.Socket) -> None:
        while True:
            if not self.scheduler.can_step():
                recv.poll(DEFERRED_POLL_MS if self.deferred else IDLE_POLL_MS)
            self._finish_deferred(send)
            replies: list[ControlReply] = []
            while recv.poll(0):
                msg = recv.recv_pyobj()
                if isinstance(msg, ControlRequest):
                    # A control call sees no batch in flight, and that batch's outputs leave
                    # first: stamped with the weight version that computed them.
                    self.scheduler.drain()
                    self._send_outputs(send, self.scheduler.take_reports())
                reply = self.handle(msg)
                if reply is not None:
                    replies.append(reply)
            shutdown = [r for r in replies if r.result == "shutdown"]
            replies = [r for r in replies if r.result != "shutdown"]
            self._send_outputs(send, self.scheduler.step())
            for reply in replies:
                send.send_pyobj(reply)
            if shutdown:
                send.send_pyobj(shutdown[0])
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
            result = deferred.finish()
            if isinstance(result, Deferred):
                waiting.append((call_id, result))
            else:
                send.send_pyobj(ControlReply(call_id, result))
        self.deferred = waiting

    def _send_outputs(self, send: zmq.Socket, done: list) -> None:
        if done:
            # A request may appear twice (streamed, then aborted): report it once.
            unique = list({id(r): r for r in done}.values())
            send.send_pyobj(ReqOutputBatch([self.scheduler.make_output(r) for r in unique]))


def run_scheduler_process(options: EngineOptions, addrs: Addresses, parent_pid: int) -> None:
    watch_parent(parent_pid)
    logging.basicConfig(level=logging.WARNING, format="[scheduler] %(levelname)s %(message)s")
    ctx = zmq.Context()
    recv = ctx.socket(zmq.PULL)
    recv.bind(addrs.scheduler)
    send = ctx.socket(zmq.PUSH)
    send.connect(addrs.detokenizer)
    try:
        proc = SchedulerProcess(options)
        send.send_pyobj(SchedulerReady(proc.info))
        proc.loop(recv, send)
    except BaseException:  # noqa: BLE001 - every failure must reach the caller
        send.send_pyobj(SchedulerFailed(traceback.format_exc()))
    finally:
        send.close(linger=2000)
        recv.close(linger=0)
        ctx.term()
