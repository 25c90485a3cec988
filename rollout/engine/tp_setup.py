"""Starting tensor-parallel ranks: each scheduler process joins the engine's own process group
(rendezvous through a file of the engine's, so a trainer's groups and ports are never touched:
these are the engine's subprocesses), takes its GPU, and wires rank 0 to the others."""

from __future__ import annotations

import datetime
import itertools
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import zmq

from rollout.config import EngineOptions
from rollout.engine.model_runner import ModelRunner, default_device
from rollout.engine.processes import Addresses
from rollout.engine.tp_follower import RankCall, RankReply, StopFollowing
from rollout.engine.tp_steps import StepSender
from rollout.forward.tensor_parallel import SINGLE, TPGroup

# How long a collective may wait for a rank (a dead rank is found by the engine's watchdog,
# which shuts the engine down; this only bounds a rank left waiting on it).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
RANK_CALL_TIMEOUT_S = 600.0


def join_group(
    options: EngineOptions, addrs: Addresses, rank: int
) -> tuple[EngineOptions, TPGroup]:
    """This rank's options (its own device) and its place in the group."""
    size = options.parallel.tp_size
    device = options.model.device or default_device()
    if size == 1:
        # One rank: on base_gpu_id (or gpu_ids[0]) unless the device names its GPU.
        if device == "cuda":
            device = f"cuda:{options.parallel.gpu_of(0)}"
            options = replace(options, model=replace(options.model, device=device))
        return options, SINGLE
    if device.startswith("cuda"):
        device = f"cuda:{options.parallel.gpu_of(rank)}"
        torch.cuda.set_device(torch.device(device))
    backend = options.parallel.tp_backend
    if backend == "auto":
        backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend, init_method=addrs.tp_init, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    options = replace(options, model=replace(options.model, device=device))
    return options, TPGroup.from_group()


class OtherRanks:
    """Rank 0's line to the other ranks: their steps (through the runner's StepSender) and
    calls that every rank runs between steps."""

    def __init__(self, ctx: zmq.Context, addrs: Addresses, runner: ModelRunner) -> None:
        self.sockets = []
        for addr in addrs.tp_steps:
            sock = ctx.socket(zmq.PUSH)
            sock.bind(addr)
            self.sockets.append(sock)
        self.replies = ctx.socket(zmq.PULL)
        self.replies.bind(addrs.tp_replies)
        self.sender = runner.step_sender = StepSender(self.sockets, runner.req_to_token)
        self._ids = itertools.count()

    def call(self, name: str, *args: object) -> list[RankReply]:
        """Runs handler `name` on every other rank (after its step in flight); their replies,
        in rank order. Raises RuntimeError if a rank doesn't answer in time."""
        call_id = next(self._ids)
        self.sender.send_message(RankCall(call_id, name, args))
        replies: dict[int, RankReply] = {}
        deadline = time.monotonic() + RANK_CALL_TIMEOUT_S
        while len(replies) < len(self.sockets):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.replies.poll(left_ms):
                missing = sorted(set(range(1, len(self.sockets) + 1)) - set(replies))
                raise RuntimeError(f"tensor-parallel ranks {missing} did not answer {name}")
            reply: RankReply = self.replies.recv_pyobj()
            if reply.call_id == call_id:
                replies[reply.rank] = reply
        return [replies[r] for r in sorted(replies)]

    def stop(self) -> None:
        self.sender.send_message(StopFollowing())

    def close(self) -> None:
        for sock in (*self.sockets, self.replies):
            sock.close(linger=1000)
