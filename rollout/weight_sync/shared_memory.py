"""Named host shared memory for tensors: how CPU tensors cross to the scheduler without pickling.

The sender creates a block (`SharedBlock.create`, unlinked by `close`, and by Python's resource
tracker if the sender dies); the receiver maps it by name (`map_block`) for as long as it reads.
Only names with our prefix are ever mapped, so a caller can't make the engine open other
processes' shared memory.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
from multiprocessing import shared_memory

import torch

from rollout.errors import InvalidRequest

PREFIX = "rollout-w-"
_NAME = re.compile(r"^rollout-w-[0-9a-f]{32}$")
_SHM_DIR = "/dev/shm"


def check_block_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequest(
            f"shared-memory name must look like {PREFIX}<32 hex digits>, got {name!r}"
        )
    return name


class SharedBlock:
    """A block this process created: `tensor` is a uint8 view of all of it."""

    def __init__(self, nbytes: int) -> None:
        self._shm = shared_memory.SharedMemory(
            name=f"{PREFIX}{uuid.uuid4().hex}", create=True, size=max(nbytes, 1)
        )
        self.name = self._shm.name.lstrip("/")
        self.nbytes = nbytes
        self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes) if nbytes else (
            torch.empty(0, dtype=torch.uint8)
        )

    def close(self) -> None:
        """Unlinks the block; its memory goes once every mapping of it is gone."""
        if self._shm is None:
            return
        shm, self._shm = self._shm, None
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            shm.close()
        except BufferError:
            pass  # a view of it is still alive somewhere: the mapping goes with it
        shm.unlink()

    def __del__(self) -> None:
        if getattr(self, "_shm", None) is not None:
            self.close()


class MappedBlock:
    """A block another process created, mapped here (read, then `close`)."""

    def __init__(self, name: str, nbytes: int) -> None:
        check_block_name(name)
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as e:
            raise InvalidRequest(
                f"no shared-memory block named {name!r} (did the sender close it?)"
            ) from e
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise InvalidRequest(
                    f"shared-memory block {name!r} holds {size} bytes, fewer than {nbytes}"
                )
            self._map = mmap.mmap(fd, max(nbytes, 1)) if nbytes else None
        finally:
            os.close(fd)
        self.tensor = (
            torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes)
            if self._map is not None
            else torch.empty(0, dtype=torch.uint8)
        )

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # views still alive: unmapped when they go
            self._map = None
