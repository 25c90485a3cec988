"""Paged KV storage: one slot per token, and the request -> slot table.

Slot 0 of the KV pool is never handed out: padded positions (CUDA-graph replay, dummy
requests) write there, so no real token's KV is ever overwritten by padding.
"""

from __future__ import annotations

import torch

# kv_cache_dtype values other than "auto"; one byte per element, no scale.
FP8_KV_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for option value `name` (CacheOptions checked it; "auto":
    the model's dtype)."""
    return model_dtype if name == "auto" else FP8_KV_DTYPES[name]


def check_kv_dtype_runs(dtype: torch.dtype, device: torch.device) -> None:
    """ValueError when this GPU cannot hold `dtype`: Triton, which stores the KV (and reads it
    on its backend), compiles e4m3 only for compute capability 8.9 and newer (Ada, Hopper);
    e5m2 it converts on older GPUs too."""
    if dtype != torch.float8_e4m3fn or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(
            f"kv_cache_dtype='fp8_e4m3' needs a GPU of compute capability 8.9 or newer, got "
            f"{major}.{minor} ({torch.cuda.get_device_name(device)}); use fp8_e5m2 or auto"
        )


def to_kv_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as stored in a cache of `dtype`: an 8-bit float type clamps to its range first (a cast
    to e5m2 alone overflows to inf), as the Triton stores do (kernels/kv_store.py)."""
    if dtype in FP8_KV_DTYPES.values():
        bound = torch.finfo(dtype).max
        return x.float().clamp(-bound, bound).to(dtype)
    return x.to(dtype)


class KVPool:
    """K and V buffers for every layer: `k[layer]`, `v[layer]` are [num_slots + 1, kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.allocate()

    def allocate(self) -> None:
        """(Re)creates the K/V buffers, zeroed."""
        shape = (self.num_slots + 1, self.num_kv_heads, self.head_dim)
        self.k = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]
        self.v = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]

    def free(self) -> None:
        """Drops the K/V buffers so their memory goes back; nothing may run until `allocate`."""
        self.k, self.v = [], []

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        )

    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes the new tokens' K/V. loc: [T]; k, v: [T, kv_heads, head_dim]."""
        self.k[layer_id][loc] = to_kv_dtype(k, self.dtype)
        self.v[layer_id][loc] = to_kv_dtype(v, self.dtype)


class SlotAllocator:
    """Free list of KV slots 1..num_slots. Who allocates a slot frees it (or hands it to the radix cache)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.num_slots + 1, dtype=torch.int64)
        self._num_free = self.num_slots

    def available(self) -> int:
        return self._num_free

    def allocate(self, n: int) -> torch.Tensor | None:
        """Returns n free slots (int64, CPU), or None when fewer than n are free."""
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].clone()
        self._num_free = start
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = slots.numel()
        if n == 0:
            return
        if self._num_free + n > self.num_slots:
            raise RuntimeError("freeing more KV slots than were allocated")
        self._free[self._num_free : self._num_free + n] = slots.to(torch.int64).cpu()
        self._num_free += n


# One write to the req->token table, as `ReqToTokenPool.replay` takes it:
# ("row", row, start, slots) or ("many", rows, cols, slots), host tensors.
TableWrite = tuple


class ReqToTokenPool:
    """Row r of `table` holds the KV slots of request r's tokens, in sequence order.

    The scheduler reads rows from `host`, a host copy kept in step with every write: freeing and
    caching a request's KV never waits for the device (which may still be computing a step).
    With `journal` set (a list), every write is also recorded there, for other tensor-parallel
    ranks to `replay` (see rollout/engine/tp_steps.py)."""

    journal: list[TableWrite] | None = None

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str) -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.table = torch.zeros((max_reqs, max_context), dtype=torch.int64, device=device)
        on_host = self.table.device.type == "cpu"
        self.host = self.table if on_host else torch.zeros_like(self.table, device="cpu")
        self._free_rows = list(range(max_reqs - 1, -1, -1))

    def available(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    # NOTE: the copies below are non-blocking from pageable memory: CUDA stages the source before
    # the call returns (so the host may reuse it at once) and does not wait for the device.
    # Pinning the source first would cost more than the copy (pin_memory checks is_pinned).
    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """table[row, start : start + len(slots)] = slots (a host tensor), copied without a sync."""
        if self.journal is not None:
            self.journal.append(("row", row, start, slots.clone()))
        self.host[row, start : start + slots.numel()] = slots
        if self.host is not self.table:
            self.table[row, start : start + slots.numel()].copy_(slots, non_blocking=True)

    def write_many(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """table[rows[i], cols[i]] = slots[i]; the three are host tensors, copied without a sync
        (in one host-to-device copy)."""
        if self.journal is not None:
            self.journal.append(("many", rows.clone(), cols.clone(), slots.clone()))
        self.host[rows, cols] = slots
        if self.host is not self.table:
            packed = torch.stack([rows, cols, slots.to(torch.int64)])  # [3, N]
            packed = packed.to(self.table.device, non_blocking=True)
            self.table[packed[0], packed[1]] = packed[2]

    def take_journal(self) -> list[TableWrite]:
        """The writes recorded since the last call (see `journal`)."""
        writes, self.journal = self.journal or [], [] if self.journal is not None else None
        return writes

    def replay(self, writes: list[TableWrite]) -> None:
        """Makes the writes another rank recorded."""
        for kind, a, b, slots in writes:
            if kind == "row":
                self.write(a, b, slots)
            else:
                self.write_many(a, b, slots)

    def read(self, row: int, start: int, end: int) -> torch.Tensor:
        """Slots of row `row`, positions start .. end: a view of the host copy."""
        return self.host[row, start:end]
