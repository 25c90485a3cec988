"""WeightTransaction: load HF-named tensors so that a whole update takes effect, or none of it.

The model's own `load_weights` copies tensor by tensor and stops at the first error, leaving
earlier tensors loaded. A transaction wraps it: the first write to each weight first saves what
the weight held (on the host or the device), so `rollback` can put every saved value back
bitwise. Sources that hold every tensor before the first write (and were validated) need no
backup: nothing after validation can fail but the device itself.
"""

from __future__ import annotations

import torch
from torch import nn

from rollout.config import BACKUPS

# What a device backup ("auto") leaves free for everything else on the device.
AUTO_DEVICE_HEADROOM = 1 << 30


def _room_on_device(view: torch.Tensor) -> bool:
    """Whether a copy of `view` fits on its GPU with AUTO_DEVICE_HEADROOM to spare."""
    if not view.is_cuda:
        return False
    free, _ = torch.cuda.mem_get_info(view.device)
    return free > view.numel() * view.element_size() + AUTO_DEVICE_HEADROOM


class HostBuffers:
    """Host copies of a model's weights, reused from one update to the next: slices of one
    buffer the size of the model's parameters, allocated at the first copy (pinned when the
    model is on a GPU, which makes the copies asynchronous). One allocation, not one per
    weight: torch's pinned allocator rounds each up to a power of two (a 7B model's weights
    would pin nearly twice their size) and pinning is slow to set up, paid once here."""

    ALIGN = 256  # bytes: where each slice starts

    def __init__(self, params: list[torch.Tensor] | None = None) -> None:
        """params: the model's parameters, which size the buffer (None: one buffer per copy)."""
        self._capacity = 0
        if params:  # slack for the alignment of every weight, views of fused parameters too
            self._capacity = sum(p.numel() * p.element_size() + 4 * self.ALIGN for p in params)
        self._flat: torch.Tensor | None = None
        self._pinned = False
        self._used = 0
        self._buffers: dict[str, torch.Tensor] = {}

    def like(self, name: str, src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = self._slice(src)
            if buf is None:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
            self._buffers[name] = buf
        return buf

    def _slice(self, src: torch.Tensor) -> torch.Tensor | None:
        """A slice of the one buffer shaped as src, or None when it has no room left."""
        if self._flat is None and self._capacity:
            self._flat = torch.empty(self._capacity, dtype=torch.uint8, pin_memory=src.is_cuda)
            self._pinned = src.is_cuda
        nbytes = src.numel() * src.element_size()
        if self._flat is None or self._pinned != src.is_cuda:
            return None
        start = -(-self._used // self.ALIGN) * self.ALIGN
        if start + nbytes > self._capacity:
            return None
        self._used = start + nbytes
        return self._flat[start : start + nbytes].view(src.dtype).view(src.shape)

class WeightTransaction:
    def __init__(
        self,
        model: nn.Module,
        backup: str | None,
        host_buffers: HostBuffers | None = None,
        no_backup_for: frozenset[str] = frozenset(),
    ) -> None:
        """backup: one of BACKUPS (see WeightSyncOptions.weight_update_backup) or None (no
        rollback once written). `no_backup_for`: weights whose current values are worthless
        (released without a copy): never saved."""
        if backup is not None and backup not in BACKUPS:
            raise ValueError(f"backup must be one of {', '.join(BACKUPS)} or None, got {backup!r}")
        self.model = model
        self.backup = backup
        self.host_buffers = host_buffers or HostBuffers()
        self.no_backup_for = no_backup_for
        self._saved: dict[str, torch.Tensor] = {}
        self.loaded: dict[str, None] = {}  # names in first-load order

    @property
    def written(self) -> bool:
        return bool(self.loaded)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor, presharded: bool = False) -> None:
        """Writes one (validated) weight, saving its old value first when backing up. `tensor`
        is the full checkpoint tensor (this rank keeps its slice), or with `presharded` this
        tensor-parallel rank's slice."""
        if self.model.is_ignored_weight(name):
            return
        view = self.model.hf_weight(name)
        if self.backup and name not in self._saved and name not in self.no_backup_for:
            if self.backup == "device" or (self.backup == "auto" and _room_on_device(view)):
                self._saved[name] = view.clone()
            else:
                # NOTE: non_blocking is safe: the load below is queued after this copy on the
                # same stream, so the copy reads the old values.
                self._saved[name] = self.host_buffers.like(name, view).copy_(
                    view, non_blocking=True
                )
        self.loaded[name] = None
        if presharded:
            self.model.load_weights([(name, tensor)], presharded=True)
        else:
            self.model.load_weights([(name, tensor)])

    def unrecoverable(self) -> list[str]:
        """Weights written without a saved value to return to."""
        return [n for n in self.loaded if n not in self._saved and n not in self.no_backup_for]

    @torch.no_grad()
    def rollback(self) -> bool:
        """Restores every saved weight; True when the model is back to its values before the
        transaction (False: `unrecoverable()` names what could not be restored)."""
        for name in self._saved:
            self.model.hf_weight(name).copy_(self._saved[name], non_blocking=True)
        self.wait()  # no reference to a saved tensor outlives the loop: _drop_saved frees them all
        complete = not self.unrecoverable()
        self._drop_saved()
        self.loaded.clear()
        return complete

    def commit(self) -> list[str]:
        """Keeps what was loaded; returns the names written."""
        self.wait()
        self._drop_saved()
        names = list(self.loaded)
        self.loaded.clear()
        return names

    def _drop_saved(self) -> None:
        on_device = any(saved.is_cuda for saved in self._saved.values())
        self._saved.clear()
        if on_device:
            # Device backups go back to the device, not to torch's cache of free blocks: what
            # needs them next is allocated outside it (the KV cache resumed after training,
            # through torch-memory-saver, or a trainer sharing the GPU).
            torch.cuda.empty_cache()

    def wait(self) -> None:
        """Returns once every queued load and restore is done: only then may the sender reuse
        (or free) the buffers they read."""
        param = next(self.model.parameters())
        if param.is_cuda:
            torch.cuda.current_stream(param.device).synchronize()
