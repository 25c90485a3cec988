"""UpdateGroup: the process group a trainer (rank 0) and the engine's ranks join to move weights.

The rendezvous is SGLang's, so an unmodified SGLang-style trainer (slime, AReaL, verl: they build
the group with `init_process_group`-style code) and our own WeightSender meet the engine alike:
- every rank opens the store at `tcp://{master_address}:{master_port}` as
  `torch.distributed.rendezvous` does (rank 0 hosts a TCPStore and waits until all
  `world_size` ranks have connected);
- the group's keys live under `PrefixStore(group_name, store)`, and inside it where torch's
  process-group helper puts a backend's keys (`{group_name}/` then `{device}/`);
- nothing else: no handshake, no extra broadcast. The first broadcast is the first weights.

The group is made directly as a ProcessGroupGloo / ProcessGroupNCCL over that store, never
registered with `torch.distributed`'s global state, so neither side's default group is touched
(a trainer already has one). Joining and every broadcast are bounded by the group's timeout; a
group whose broadcast failed is closed (join a new one).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, BackendConfig

from rollout.errors import InvalidRequest, WeightSyncError

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
# The NCCL watchdog gets this much longer than our own deadline, so that our deadline (which
# aborts the group and reports a clear error) always fires first.
NCCL_WATCHDOG_MARGIN_S = 30.0


def check_group_args(
    master_address: Any, master_port: Any, rank: Any, world_size: Any, group_name: Any, backend: Any
) -> None:
    if not isinstance(master_address, str) or not master_address:
        raise InvalidRequest(
            f"master_address must be a host name or address, got {master_address!r}"
        )
    if not isinstance(master_port, int) or isinstance(master_port, bool) or not 0 < master_port < 65536:
        raise InvalidRequest(f"master_port must be an int in (0, 65536), got {master_port!r}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 2:
        raise InvalidRequest(
            f"world_size must be an int >= 2 (the trainer and the engine), got {world_size!r}"
        )
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise InvalidRequest(f"rank must be in [0, {world_size}), got {rank!r}")
    if not isinstance(group_name, str) or not group_name:
        raise InvalidRequest(f"group_name must be a non-empty string, got {group_name!r}")
    if backend not in BACKENDS:
        raise InvalidRequest(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


@dataclass
class UpdateGroup:
    name: str
    backend: str
    rank: int
    world_size: int
    timeout_s: float
    device: torch.device  # where broadcast buffers live: the GPU for NCCL, the host for gloo
    _pg: Any = field(repr=False, default=None)
    _store: Any = field(repr=False, default=None)

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float,
        device: torch.device | str | None = None,
    ) -> UpdateGroup:
        """Joins (rank 0: creates) the group; returns once every rank has joined (with nccl,
        ranks other than 0 return once the store is reached: the communicator forms at the
        first broadcast), or raises WeightSyncError after `timeout_s`. `device`: the GPU an
        NCCL rank uses."""
        check_group_args(master_address, master_port, rank, world_size, group_name, backend)
        if backend == "nccl":
            if device is None or torch.device(device).type != "cuda":
                raise InvalidRequest(
                    f"the nccl backend needs a CUDA device, got {device!r}; use gloo"
                )
            # Our own deadline aborts the group; the watchdog must not end the process instead.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        buffers = torch.device(device) if backend == "nccl" else torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            pg, store = _open(master_address, master_port, rank, world_size, group_name, backend, timeout)
        except (RuntimeError, OSError, ValueError) as e:
            raise WeightSyncError(
                f"could not join weight update group {group_name!r} at {master_address}:{master_port} "
                f"as rank {rank} of {world_size} within {timeout_s:g} s: {e}"
            ) from e
        return cls(group_name, backend, rank, world_size, timeout_s, buffers, pg, store)

    def broadcast(self, tensor: torch.Tensor, what: str = "a broadcast") -> None:
        """Sends `tensor` (rank 0) or receives into it (others), within the group's timeout.
        On failure the group is closed and WeightSyncError raised."""
        if self._pg is None:
            raise WeightSyncError(f"weight update group {self.name!r} is closed; join a new one")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = datetime.timedelta(seconds=self.timeout_s)
        try:
            work = self._pg.broadcast([tensor], opts)
            self._wait(work)
        except (RuntimeError, TimeoutError) as e:
            self.close(failed=True)
            if "Duplicate GPU" in str(e):
                raise InvalidRequest(
                    f"two ranks of weight update group {self.name!r} are on the same GPU; NCCL "
                    f"needs one GPU per rank. For a trainer on the engine's GPU use "
                    f"update_weights_from_tensor (CUDA IPC handles), or gloo ({e})"
                ) from e
            peer = "the trainer" if self.rank else "an engine rank"
            raise WeightSyncError(
                f"{what} in weight update group {self.name!r} failed ({peer} died, stalled for "
                f"{self.timeout_s:g} s, or left): {e}. The group is closed; join a new one."
            ) from e

    def _wait(self, work: Any) -> None:
        if self.backend == "gloo":
            work.wait(datetime.timedelta(seconds=self.timeout_s))
            return
        # NCCL's wait only orders streams; poll its completion on the host to bound the time.
        deadline = time.monotonic() + self.timeout_s
        pause = 2e-5
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no completion within {self.timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        work.wait()  # raises the transport's error, if any

    def close(self, failed: bool = False) -> None:
        """Leaves the group. A healthy group is shut down and dropped here; NCCL's shutdown
        finalizes with the other ranks (they leave at the same time: WeightSender asks the
        engine to leave while it does), so it gets the group's timeout and is then aborted.
        After a failure the group is aborted first; dropping it may then block until its own
        timeout, so that happens on a background thread. (A group left for a daemon thread to
        drop can abort the whole process if it exits meanwhile: only a failed group, or an
        NCCL group whose peers never left, takes that risk.)"""
        held = [self._pg, self._store]
        self._pg = self._store = None
        if held[0] is None:
            return
        if not failed and self.backend == "nccl":
            if _within(held[0].shutdown, self.timeout_s):
                held.clear()
                return
            logger.warning(
                "weight update group %r: the other ranks did not leave within %g s; aborting",
                self.name, self.timeout_s,
            )  # fmt: skip
            failed = True
        if failed:
            # Bounded too: an abort that follows a shutdown still under way can wait on it.
            if not _within(held[0].abort, self.timeout_s):
                logger.warning(
                    "weight update group %r: its abort did not end within %g s; left to a "
                    "background thread", self.name, self.timeout_s,
                )  # fmt: skip
            threading.Thread(target=held.clear, name=f"drop-{self.name}", daemon=True).start()
            return
        try:
            held[0].shutdown()
        except RuntimeError as e:
            logger.warning("closing weight update group %r: %s", self.name, e)
        held.clear()

    @property
    def closed(self) -> bool:
        return self._pg is None


def _within(fn: Any, timeout_s: float) -> bool:
    """Runs fn() on a daemon thread; whether it returned (an exception counts) in time."""
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        except RuntimeError as e:
            logger.warning("closing a weight update group: %s", e)
        finally:
            done.set()

    threading.Thread(target=run, name="group-shutdown", daemon=True).start()
    return done.wait(timeout_s)


def _open(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    backend: str, timeout: datetime.timedelta,
) -> tuple[Any, Any]:  # fmt: skip
    """The backend process group and its store, keyed exactly as an SGLang-style trainer's
    `init_custom_process_group(init_method="tcp://...", group_name=...)` keys its own."""
    url = f"tcp://{master_address}:{master_port}"
    store, _, _ = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    grouped = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    # NOTE: torch's process-group helper gives each device's backend the prefix "{device}/";
    # gloo serves both devices with one backend under the first ("cpu"), nccl is "cuda".
    device = next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))
    keys = dist.PrefixStore(f"{device}/", grouped)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(keys, rank, world_size, timeout)
    else:
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout + datetime.timedelta(seconds=NCCL_WATCHDOG_MARGIN_S)
        pg = dist.ProcessGroupNCCL(keys, rank, world_size, opts)
    pg._set_sequence_number_for_group()  # as the helper does; gloo ranks > 0 read rank 0's
    return pg, store
