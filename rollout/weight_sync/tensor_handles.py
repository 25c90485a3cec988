"""Named tensors by reference, as plain JSON: how a handoff crosses process boundaries.

On a GPU only CUDA IPC handles travel, never the bytes; on the host, the name of a shared-memory
block. The form is data only (names, dtypes, shapes, offsets, base64 handles), so a server can
take it from the network without unpickling anything: `TensorHandles.from_json` checks every
field, and the receiver maps nothing but IPC handles and blocks with our name prefix.

    sent = share_tensors(named_or_buckets)      # sender; keep `sent` until the receiver is done
    payload = sent.handles.to_json()            # JSON-safe dict
    opened = open_tensors(TensorHandles.from_json(payload))   # receiver (checks every field)
    ... opened.named ...; opened.close(); later sent.close()
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.control import settle
from rollout.errors import InvalidRequest, InvalidRequestType
from rollout.weight_sync.flat_bucket import FlatBucket
from rollout.weight_sync.shared_memory import MappedBlock, check_block_name
from rollout.weight_sync.specs import (
    DTYPES,
    WeightSpec,
    check_name,
    check_unique,
    dtype_name,
    parse_dtype,
    parse_shape,
)

FORMAT = "rollout.tensor_handles/1"
MAX_BUFFERS = 100_000
MAX_TENSORS = 1_000_000
_CUDA_INTS = ("device", "nbytes", "offset", "ref_counter_offset")
_CUDA_BYTES = ("handle", "ref_counter_handle", "event_handle")
_CUDA_KEYS = {*_CUDA_INTS, *_CUDA_BYTES, "event_sync_required"}
_TENSOR_KEYS = {"name", "dtype", "shape", "buffer", "offset"}


@dataclass(frozen=True)
class TensorHandles:
    """Reference form, checked field by field where it is built (the sender's own handles as
    well as ones from the network): `buffers` (IPC handles or block names) and `tensors` (name,
    dtype, shape, buffer index, byte offset). InvalidRequest names the first bad field."""

    kind: str  # "cuda" | "cpu"
    buffers: list[dict[str, Any]]
    tensors: list[dict[str, Any]]

    def __post_init__(self) -> None:
        kind, buffers, tensors = self.kind, self.buffers, self.tensors
        if kind not in ("cuda", "cpu"):
            raise InvalidRequest(f"tensor handles kind must be cuda or cpu, got {kind!r}")
        if not isinstance(buffers, list) or not 0 < len(buffers) <= MAX_BUFFERS:
            raise InvalidRequest(f"buffers must be a list of 1 to {MAX_BUFFERS} entries")
        if not isinstance(tensors, list) or not 0 < len(tensors) <= MAX_TENSORS:
            raise InvalidRequest(f"tensors must be a list of 1 to {MAX_TENSORS} entries")
        check = _check_cuda_buffer if kind == "cuda" else _check_cpu_buffer
        checked = [check(b) for b in buffers]
        out = [_check_tensor(t, checked) for t in tensors]
        check_unique([t["name"] for t in out])
        settle(self, "buffers", checked)
        settle(self, "tensors", out)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "kind": self.kind, "buffers": self.buffers, "tensors": self.tensors}

    @classmethod
    def from_json(cls, obj: Any) -> TensorHandles:
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise InvalidRequest(f"tensor handles must be an object with format {FORMAT!r}")
        return cls(obj.get("kind"), obj.get("buffers"), obj.get("tensors"))

    @property
    def specs(self) -> list[WeightSpec]:
        return [WeightSpec(t["name"], tuple(t["shape"]), parse_dtype(t["dtype"])) for t in self.tensors]


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidRequest(f"{what} must be a non-negative int, got {value!r}")
    return value


def _b64(value: Any, what: str) -> str:
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, TypeError, ValueError) as e:
        raise InvalidRequest(f"{what} must be base64 text") from e
    return value


def _check_cpu_buffer(b: Any) -> dict[str, Any]:
    if not isinstance(b, dict) or set(b) != {"shm", "nbytes"}:
        raise InvalidRequest("a cpu buffer must be {shm, nbytes}")
    return {"shm": check_block_name(b["shm"]), "nbytes": _int(b["nbytes"], "nbytes")}


def _check_cuda_buffer(b: Any) -> dict[str, Any]:
    if not isinstance(b, dict) or set(b) != _CUDA_KEYS:
        raise InvalidRequest(
            f"a cuda buffer must have exactly {sorted(_CUDA_KEYS)}"
        )
    out: dict[str, Any] = {k: _int(b[k], k) for k in _CUDA_INTS}
    out.update({k: _b64(b[k], k) for k in _CUDA_BYTES})
    if not isinstance(b["event_sync_required"], bool):
        raise InvalidRequest("event_sync_required must be a bool")
    out["event_sync_required"] = b["event_sync_required"]
    return out


def _check_tensor(t: Any, buffers: list[dict[str, Any]]) -> dict[str, Any]:
    # NOTE: runs for every tensor of every handoff, on both sides: plain checks, no objects.
    if not isinstance(t, dict) or t.keys() != _TENSOR_KEYS:
        raise InvalidRequest("a tensor must be {name, dtype, shape, buffer, offset}")
    name = check_name(t["name"])
    shape, dtype = parse_shape(t["shape"], name), parse_dtype(t["dtype"])
    index, offset = _int(t["buffer"], "buffer"), _int(t["offset"], "offset")
    if index >= len(buffers):
        raise InvalidRequest(f"{name}: buffer {index} does not exist ({len(buffers)} given)")
    nbytes = math.prod(shape) * dtype.itemsize
    if offset % dtype.itemsize or offset + nbytes > buffers[index]["nbytes"]:
        raise InvalidRequest(f"{name}: {nbytes} bytes at offset {offset} do not fit buffer {index}")
    return {"name": name, "dtype": dtype_name(dtype), "shape": list(shape), "buffer": index, "offset": offset}


# ---- sending ---------------------------------------------------------------------------------
@dataclass
class SentTensors:
    """What the sender keeps alive until the receiver has read: the handles, the tensors they
    point at, and any shared-memory block made for this send."""

    handles: TensorHandles
    keep: list[Any] = field(default_factory=list)
    owned: list[FlatBucket] = field(default_factory=list)  # made for this send: freed by close

    def close(self) -> None:
        for bucket in self.owned:
            bucket.close()
        self.owned.clear()
        self.keep.clear()


def share_tensors(source: Sequence[tuple[str, torch.Tensor]] | FlatBucket | Sequence[FlatBucket]) -> SentTensors:
    """Handles for named tensors or buckets (all on one kind of device). Host tensors that are
    not already in a shared bucket are copied into a new block, freed by `close`."""
    if isinstance(source, FlatBucket):
        source = [source]
    source = list(source)
    if not source:
        raise InvalidRequest("nothing to send: give at least one tensor")
    if all(isinstance(s, FlatBucket) for s in source):
        buckets = source
    elif all(isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], torch.Tensor) for s in source):
        buckets = None
    else:
        raise InvalidRequestType(
            "send a list of (name, tensor) pairs, a FlatBucket, or a list of FlatBuckets"
        )
    devices = {(b.device if buckets else b[1].device).type for b in source}
    if len(devices) != 1 or not devices <= {"cuda", "cpu"}:
        raise InvalidRequest(
            f"all tensors must be on CUDA devices or all on the host, got {sorted(devices)}"
        )
    if devices == {"cuda"}:
        return _share_cuda(source, buckets is not None)
    if buckets is not None:
        return _share_cpu(buckets)
    sent = _share_cpu([FlatBucket.pack(source, "cpu")])
    sent.owned = list(sent.keep)
    return sent


def _share_cpu(buckets: list[FlatBucket]) -> SentTensors:
    buffers, tensors = [], []
    for i, bucket in enumerate(buckets):
        if bucket.block is None:
            raise InvalidRequest(
                "a host bucket must be shared (FlatBucket.allocate(..., shared=True))"
            )
        buffers.append({"shm": bucket.block.name, "nbytes": bucket.buffer.numel()})
        tensors += [_entry(e.spec, i, e.offset) for e in bucket.entries]
    return SentTensors(TensorHandles("cpu", buffers, tensors), list(buckets))


def _share_cuda(source: list, bucketed: bool) -> SentTensors:
    named = [(None, b.buffer, b.entries) for b in source] if bucketed else [(n, t, None) for n, t in source]
    buffers: list[dict[str, Any]] = []
    index: dict[tuple[int, int], int] = {}
    tensors, keep = [], []
    # NOTE: the receiver reads on its own stream; pending writes here must land first.
    for dev in {t.device for _, t, _ in named}:
        torch.cuda.current_stream(dev).synchronize()
    for name, tensor, entries in named:
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()  # a new storage each send: slower, still correct
        keep.append(tensor)
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device.index)
        if key not in index:
            index[key] = len(buffers)
            buffers.append(_cuda_buffer(storage))
        base = tensor.storage_offset() * tensor.element_size()
        if entries is None:
            tensors.append(_entry(WeightSpec(name, tuple(tensor.shape), tensor.dtype), index[key], base))
        else:
            tensors += [_entry(e.spec, index[key], base + e.offset) for e in entries]
    return SentTensors(TensorHandles("cuda", buffers, tensors), keep)


def _cuda_buffer(storage: torch.UntypedStorage) -> dict[str, Any]:
    device, handle, nbytes, offset, rc_handle, rc_offset, ev_handle, ev_sync = storage._share_cuda_()
    enc = lambda b: base64.b64encode(b or b"").decode()  # noqa: E731
    return {
        "device": device, "nbytes": nbytes, "offset": offset, "ref_counter_offset": rc_offset,
        "handle": enc(handle), "ref_counter_handle": enc(rc_handle), "event_handle": enc(ev_handle),
        "event_sync_required": bool(ev_sync),
    }


def _entry(spec: WeightSpec, buffer: int, offset: int) -> dict[str, Any]:
    return {"name": spec.name, "dtype": dtype_name(spec.dtype), "shape": list(spec.shape), "buffer": buffer, "offset": offset}


# ---- receiving -------------------------------------------------------------------------------
@dataclass
class OpenedTensors:
    """The receiver's views of sent tensors. Keep it while reading; CUDA buffers kept open past
    the call make the next send of the same buffers fast (the handle is already open)."""

    named: list[tuple[str, torch.Tensor]]
    buffers: list[Any]

    def close(self) -> None:
        self.named = []
        for buf in self.buffers:
            if isinstance(buf, MappedBlock):
                buf.close()
        self.buffers = []


def check_receivable(handles: TensorHandles) -> None:
    """CUDA IPC handles open only in a process that has CUDA: elsewhere that is the sender's
    mistake (ValueError), not a failed transfer."""
    if handles.kind == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest(
            "CUDA tensor handles need a GPU engine, and this engine runs without CUDA; send host "
            "tensors instead (they travel as shared memory)"
        )


def open_tensors(handles: TensorHandles) -> OpenedTensors:
    check_receivable(handles)
    if handles.kind == "cpu":
        blocks = [MappedBlock(b["shm"], b["nbytes"]) for b in handles.buffers]
        raws = [b.tensor for b in blocks]
    else:
        blocks = raws = [_open_cuda(b) for b in handles.buffers]
    named = []
    for t in handles.tensors:  # checked where the handles were built: no check again
        dtype, offset = DTYPES[t["dtype"]], t["offset"]
        raw = raws[t["buffer"]][offset : offset + math.prod(t["shape"]) * dtype.itemsize]
        named.append((t["name"], raw.view(dtype).view(t["shape"])))
    return OpenedTensors(named, list(blocks))


def _open_cuda(b: dict[str, Any]) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if b["nbytes"] == 0:
        return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", b["device"]))
    dec = base64.b64decode
    # The whole shared storage as bytes; torch caches opened handles by (handle, offset).
    return rebuild_cuda_tensor(
        torch.Tensor, (b["nbytes"],), (1,), 0, torch.UntypedStorage, torch.uint8,
        b["device"], dec(b["handle"]), b["nbytes"], b["offset"], False,
        dec(b["ref_counter_handle"]), b["ref_counter_offset"], dec(b["event_handle"]),
        b["event_sync_required"],
    )
