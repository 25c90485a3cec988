"""A tensor-parallel rank other than 0: runs the steps rank 0 decides, and nothing else.

It holds its shard of the model and of the KV cache, no scheduler: every `Step` from rank 0
becomes the same ScheduleBatch rank 0 launched (see tp_steps.py), launched here in the same
order so the forward's collectives line up. As on rank 0, one step stays in flight while the
next is launched. Control messages (weight and memory calls) run between steps, after the step
in flight is done, and are answered on the replies socket.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from rollout.engine.launched_step import LaunchedStep
from rollout.engine.model_runner import ModelRunner
from rollout.engine.tp_steps import Step, StepReceiver

logger = logging.getLogger(__name__)

POLL_MS = 1000


@dataclass(frozen=True)
class StopFollowing:
    """Rank 0 is shutting down: the rank exits once its step in flight is done."""


@dataclass(frozen=True)
class RankCall:
    """A call every rank runs between steps (rank 0 waits for each rank's RankReply)."""

    call_id: int
    name: str  # the follower's handler
    args: tuple = ()


@dataclass(frozen=True)
class RankReply:
    call_id: int
    rank: int
    result: Any = None
    error: str | None = None  # the exception's type and message


class Follower:
    def __init__(self, runner: ModelRunner, handlers: dict[str, Any] | None = None) -> None:
        self.runner = runner
        self.receiver = StepReceiver(runner.req_to_token)
        self.handlers = handlers or {}
        self.in_flight: LaunchedStep | None = None

    def run(self, recv: zmq.Socket, send: zmq.Socket) -> None:
        while True:
            if not recv.poll(POLL_MS):
                continue
            message = recv.recv_pyobj()
            if isinstance(message, Step):
                self.step(message)
                continue
            self.finish_in_flight()
            if isinstance(message, StopFollowing):
                return
            if isinstance(message, RankCall):
                send.send_pyobj(self.call(message))

    def step(self, step: Step) -> None:
        try:
            launched = self.runner.launch(self.receiver.batch(step))
        except Exception:  # noqa: BLE001 - rank 0 fails the same step and isolates its requests
            logger.exception("tensor-parallel rank %d: a step failed", self.runner.tp.rank)
            return
        self.finish_in_flight()
        self.in_flight = launched

    def finish_in_flight(self) -> None:
        if self.in_flight is not None:
            step, self.in_flight = self.in_flight, None
            try:
                step.wait()
            except Exception:  # noqa: BLE001 - as in `step`
                logger.exception("tensor-parallel rank %d: a step failed", self.runner.tp.rank)

    def call(self, call: RankCall) -> RankReply:
        rank = self.runner.tp.rank
        try:
            return RankReply(call.call_id, rank, self.handlers[call.name](*call.args))
        except Exception as e:  # noqa: BLE001 - rank 0 decides what a failure means
            logger.exception("tensor-parallel rank %d: %s failed", rank, call.name)
            return RankReply(call.call_id, rank, error=f"{type(e).__name__}: {e}")


def rank_memory(runner: ModelRunner) -> dict[str, Any]:
    """What one rank holds: its weights' and KV cache's bytes, and its device's bytes allocated
    by torch and reserved by torch's allocator (the allocated ones and its cache of free ones)."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    allocated = reserved = None
    if runner.device.type == "cuda":
        allocated = torch.cuda.memory_allocated(runner.device)
        reserved = torch.cuda.memory_reserved(runner.device)
    return {
        "rank": runner.tp.rank,
        "device": str(runner.device),
        "weights_bytes": weights,
        "kv_cache_bytes": runner.kv_pool.nbytes,
        "memory_allocated_bytes": allocated,
        "memory_reserved_bytes": reserved,
    }
