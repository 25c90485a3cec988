"""SGLang's `serialized_named_tensors`, opened through a restricted unpickler.

An SGLang-style trainer sends `update_weights_from_tensor` one payload per tensor-parallel rank:
base64 text (or bytes) of a pickle made by torch's ForkingPickler (SGLang's
MultiprocessingSerializer) of either
- load_format None: a list of (name, tensor) pairs, or
- load_format "flattened_bucket": {"flattened_tensor": 1-D uint8 tensor, "metadata": [records
  with name, shape, dtype, start_idx, end_idx, numel]}, each tensor's bytes at
  [start_idx, end_idx) of the flattened tensor.
The tensors travel by reference: CUDA IPC handles, or host shared memory by file name (the
sender must use `torch.multiprocessing.set_sharing_strategy("file_system")`; a file
descriptor cannot cross an HTTP call).

This is network data, so it is never unpickled in general: `RestrictedUnpickler` resolves only
the globals torch's tensor reductions need (the rebuild functions, storage and tensor classes,
dtypes, torch.Size, OrderedDict) plus a plain stand-in for the bucket's metadata records, each
rebuild checked before it runs; any other global is refused (InvalidRequest) before it is
resolved, so nothing of the payload runs and the weights stay as they were.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import pickle
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from rollout.errors import InvalidRequest, InvalidRequestType
from rollout.weight_sync.specs import WeightSpec, check_name, check_unique, parse_dtype, parse_shape

_TORCH_SHM_NAME = re.compile(rb"^/torch_\d+_\d+_\d+$")
_TORCH_SHM_MANAGER = re.compile(rb"^/[^\0]*/torch-shm-dir-[^/\0]+/manager\.sock$")
_STORAGES = (torch.UntypedStorage, torch.TypedStorage)
_TENSORS = (torch.Tensor, torch.nn.Parameter)


def decode(payload: Any, what: str = "serialized_named_tensors entry") -> bytes:
    """The pickle bytes of one payload: base64 text (as SGLang sends it over HTTP) or bytes."""
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    if not isinstance(payload, str):
        raise InvalidRequestType(f"a {what} must be base64 text or bytes, got {type(payload).__name__}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidRequest(f"a {what} must be base64 text: {e}") from None


def as_text(payload: Any) -> str:
    """The payload as base64 text (its JSON form), checked to decode."""
    data = decode(payload)
    return payload if isinstance(payload, str) else base64.b64encode(data).decode()


class BucketRecord:
    """What the metadata records of a flattened bucket unpickle into (SGLang's
    FlattenedTensorMetadata, whatever module the sender defined it in): attributes only."""

    FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a slotted class
            state = {**(state[0] or {}), **(state[1] or {})}
        if not isinstance(state, dict) or not set(self.FIELDS) <= set(state):
            raise InvalidRequest(f"a flattened-bucket metadata record must have {list(self.FIELDS)}")
        for key in self.FIELDS:
            object.__setattr__(self, key, state[key])


# ---- the rebuilds allowed, each checking what it is given -------------------------------------
def _rebuild_storage_filename(cls: Any, manager: Any, handle: Any, size: Any, dtype: Any = None) -> Any:
    if cls not in _STORAGES or not isinstance(size, int) or size < 0:
        raise InvalidRequest("a shared-memory storage must name a torch storage class and a size")
    if not isinstance(handle, bytes) or not _TORCH_SHM_NAME.match(handle):
        raise InvalidRequest(f"a shared-memory storage must be torch's, got the name {handle!r:.80}")
    if not isinstance(manager, bytes) or not _TORCH_SHM_MANAGER.match(manager):
        raise InvalidRequest(f"a shared-memory storage must name torch's shm manager, got {manager!r:.120}")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise InvalidRequest("a shared-memory storage's dtype must be a torch dtype")
    try:
        return reductions.rebuild_storage_filename(cls, manager, handle, size, dtype)
    except RuntimeError as e:
        raise InvalidRequest(
            f"could not open the shared-memory tensor {handle.decode()!r} (did the sender free "
            f"it before the engine answered?): {e}"
        ) from e


def _rebuild_storage_fd(*_: Any) -> Any:
    raise InvalidRequest(
        "host tensors shared by file descriptor cannot reach the engine this way: call "
        "torch.multiprocessing.set_sharing_strategy('file_system') before serializing them "
        "(or send CUDA tensors)"
    )


def _rebuild_tensor(cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
    if cls not in _TENSORS or not isinstance(storage, _STORAGES) or not isinstance(metadata, tuple):
        raise InvalidRequest("a tensor must be rebuilt from a torch storage")
    return reductions.rebuild_tensor(cls, storage, metadata)


def _rebuild_typed_storage(storage: Any, dtype: Any) -> Any:
    if not isinstance(storage, torch.UntypedStorage) or not isinstance(dtype, torch.dtype):
        raise InvalidRequest("a typed storage must wrap a torch storage with a torch dtype")
    return reductions.rebuild_typed_storage(storage, dtype)


def _rebuild_storage_empty(cls: Any) -> Any:
    if cls not in _STORAGES:
        raise InvalidRequest("an empty storage must be a torch storage class")
    return cls()


def _check_cuda() -> None:
    if not torch.cuda.is_available():
        raise InvalidRequest(
            "CUDA tensor handles need a GPU engine, and this engine runs without CUDA; send host "
            "tensors instead (shared by file name: torch.multiprocessing.set_sharing_strategy"
            "('file_system'))"
        )


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    _check_cuda()
    if len(args) != 15 or args[0] not in _TENSORS or args[4] not in _STORAGES:
        raise InvalidRequest("a CUDA tensor handle must name a torch tensor and storage class")
    return reductions.rebuild_cuda_tensor(*args)


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's serializer names the device by its UUID (so that a handle means the same GPU
    in processes with different CUDA_VISIBLE_DEVICES): back to this process's index."""
    _check_cuda()
    device = args[6] if len(args) > 6 else None
    if isinstance(device, str):
        found = [
            i for i in range(torch.cuda.device_count())
            if str(torch.cuda.get_device_properties(i).uuid) == device
        ]  # fmt: skip
        if not found:
            raise InvalidRequest(f"no GPU with UUID {device!r} is visible to this engine")
        args = (*args[:6], found[0], *args[7:])
    return _rebuild_cuda_tensor(*args)


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _rebuild_tensor,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"): _rebuild_storage_filename,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"): _rebuild_storage_fd,
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"): _rebuild_storage_empty,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _rebuild_typed_storage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "TypedStorage"): torch.TypedStorage,
    ("torch", "Tensor"): torch.Tensor,
    ("torch", "Size"): torch.Size,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,
}
# Classes and functions that senders define in modules of their own (SGLang, slime, miles):
# matched by name only and never imported; each maps to our own stand-in.
_BY_NAME: dict[str, Any] = {
    "FlattenedTensorMetadata": BucketRecord,
    "_rebuild_cuda_tensor_modified": _rebuild_cuda_tensor_by_uuid,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals above; anything else is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name), _BY_NAME.get(name))
        if found is None and module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise InvalidRequest(
                f"serialized_named_tensors may hold only torch tensors (pickled by torch's "
                f"ForkingPickler); refused the global {module}.{name}"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise InvalidRequest("serialized_named_tensors may not hold persistent references")


def unpickle(payload: Any) -> Any:
    """The object pickled in one payload, resolved through RestrictedUnpickler."""
    try:
        return RestrictedUnpickler(io.BytesIO(decode(payload))).load()
    except InvalidRequest:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise InvalidRequest(f"a serialized_named_tensors entry is not a valid tensor pickle: {e}") from e


def load_named_tensors(payload: Any, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one payload, checked to be what `load_format` says."""
    obj = unpickle(payload)
    if load_format == "flattened_bucket":
        return bucket_pairs(obj)
    if isinstance(obj, dict):
        obj = list(obj.items())
    if not isinstance(obj, (list, tuple)) or not obj:
        raise InvalidRequest("a serialized_named_tensors entry must hold a non-empty list of (name, tensor)")
    pairs = []
    for pair in obj:
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[1], torch.Tensor)
        if not ok:
            raise InvalidRequest("a serialized_named_tensors entry must hold (name, tensor) pairs")
        pairs.append((check_name(pair[0]), pair[1]))
    check_unique([n for n, _ in pairs])
    return pairs


def bucket_pairs(bucket: Any) -> list[tuple[str, torch.Tensor]]:
    """SGLang's flattened bucket {"flattened_tensor", "metadata"} as (name, tensor) pairs, each
    checked to lie inside the flattened tensor."""
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        raise InvalidRequest("a flattened bucket must be {'flattened_tensor': tensor, 'metadata': [...]}")
    flat, records = bucket["flattened_tensor"], bucket["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not flat.is_contiguous():
        raise InvalidRequest("a flattened bucket's flattened_tensor must be a contiguous 1-D tensor")
    if not isinstance(records, (list, tuple)) or not records:
        raise InvalidRequest("a flattened bucket's metadata must be a non-empty list")
    raw = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
    pairs = [_bucket_view(raw, flat.element_size(), r) for r in records]
    check_unique([n for n, _ in pairs])
    return pairs


def _bucket_view(raw: torch.Tensor, unit: int, record: Any) -> tuple[str, torch.Tensor]:
    get: Callable[[str], Any] = (
        record.get if isinstance(record, dict) else lambda k: getattr(record, k, None)
    )
    name = check_name(get("name"))
    spec = WeightSpec(name, parse_shape(list(get("shape") or ()), name), parse_dtype(get("dtype")))
    start, end = get("start_idx"), get("end_idx")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
        raise InvalidRequest(f"{name}: start_idx and end_idx must be ints")
    # Indices count elements of the flattened tensor (bytes for SGLang's uint8 buckets).
    start, end = start * unit, end * unit
    if not 0 <= start <= end <= raw.numel() or end - start != spec.nbytes:
        raise InvalidRequest(
            f"{name}: bytes [{start}, {end}) do not hold a {list(spec.shape)} "
            f"{spec.dtype} tensor inside a {raw.numel()}-byte bucket"
        )
    view = raw[start:end]
    if start % spec.dtype.itemsize:
        view = view.clone()  # an offset the dtype can't view in place
    return name, view.view(spec.dtype).view(spec.shape)
