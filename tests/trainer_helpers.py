"""A trainer process that fails mid-update, for the tests of what the engine does then."""

from __future__ import annotations

import time

import torch


def doomed_trainer(
    port: int, world_size: int, shapes: list[list[int]], ready, sent, gpu: int | None = None
) -> None:
    """Rank 0 of weight update group "doomed" (gloo, or NCCL from GPU `gpu`): broadcasts a
    random tensor of each of `shapes` (none: a flattened bucket that never comes), sets `sent`,
    then waits to be killed, or for the engine to give up on it."""
    from rollout.weight_sync.update_group import UpdateGroup

    device = "cpu" if gpu is None else f"cuda:{gpu}"
    if gpu is not None:
        torch.cuda.set_device(gpu)
    ready.set()  # imports done: the engine may start joining now
    backend = "gloo" if gpu is None else "nccl"
    group = UpdateGroup.join("127.0.0.1", port, 0, world_size, "doomed", backend, 60, device)
    for shape in shapes:
        group.broadcast(torch.randn(shape, device=device), "sending")
    sent.set()
    time.sleep(120)
