"""What the pool tests share: the transformers reference, the trainer's side of a gloo
broadcast, and a stand-in for the engine's discard_staged_weights where it has none yet."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import hf_reference
import torch
from safetensors.torch import load_file

NEW_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
# A long one (several prefix blocks) and short ones.
PROMPTS = [[(7 * i + 3) % 800 + 3 for i in range(n)] for n in (40, 5, 17)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hf_greedy(path: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    return hf_reference.hf_greedy(path, prompts, new_tokens)


def weights(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def broadcast_update(
    target: Any, named: dict[str, torch.Tensor], world_size: int, version: str,
    group: str = "trainer", backend: str = "gloo", device: str | None = None,
) -> dict:  # fmt: skip
    """The trainer's side of a distributed update (gloo, or nccl from `device`): rank 0 of a
    fresh group that every rank of `target` (an engine, a pool, a client of a router) joins;
    one broadcast; then both sides leave the group at once, as NCCL's shutdown wants."""
    from rollout.weight_sync import distributed_source
    from rollout.weight_sync.update_group import UpdateGroup

    port, pool = free_port(), ThreadPoolExecutor(1)
    joined = pool.submit(
        target.init_weights_update_group, "127.0.0.1", port, 1, world_size, group, backend, 60
    )
    trainer = UpdateGroup.join("127.0.0.1", port, 0, world_size, group, backend, 60, device)
    joined.result()
    try:
        pairs = [(n, t if device is None else t.to(device)) for n, t in named.items()]
        done = pool.submit(
            target.update_weights_from_distributed, [n for n, _ in pairs],
            ["float32"] * len(pairs), [list(t.shape) for _, t in pairs], group,
            weight_version=version,
        )  # fmt: skip
        distributed_source.send(trainer, pairs, None)
        return done.result(timeout=120)
    finally:
        left = pool.submit(target.destroy_weights_update_group, group)
        trainer.close()
        left.result(timeout=120)


def discard_by_refusal(engine: Any) -> dict:
    """Drops what a paused engine staged, through its documented rule that a staged update
    failing takes every staged one down with it: a reload from a path that is no checkpoint."""
    try:
        engine.update_weights_from_disk("/nonexistent-rollout-checkpoint")
    except ValueError as e:
        return {"success": True, "message": f"dropped the staged updates ({e})"}
    raise AssertionError("a reload from a missing checkpoint succeeded")


def install_discard_fallback() -> None:
    """Gives RolloutEngine a discard_staged_weights in this process if it has none yet (run
    in every Ray worker, through ray.init's worker_process_setup_hook)."""
    from rollout.engine.engine import RolloutEngine

    if not hasattr(RolloutEngine, "discard_staged_weights"):
        RolloutEngine.discard_staged_weights = discard_by_refusal


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.2
) -> None:
    """Polls `condition` every `interval` seconds. To catch a state that lasts a fraction of a
    second (a tiny model's requests running), poll with a short interval."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(interval)
