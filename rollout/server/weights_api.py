"""Weight-sync and memory endpoints, SGLang's names and payloads (admin-only: see guard.py).

Each body below is the JSON shape of one call of rollout/weight_sync/calls.py (types only): the
engine method of the same name builds the call, which checks the values, and a refusal is
answered by the status of its kind (rollout/errors.py). Tensor handoff over HTTP takes
`tensor_handles`, the JSON form of TensorHandles (names, dtypes, shapes, CUDA IPC handles or
shared-memory block names), or SGLang's `serialized_named_tensors`, which the scheduler opens
through a restricted unpickler that resolves nothing but torch's tensor rebuilds (see
rollout/weight_sync/serialized_tensors.py): never a general unpickle. Disk reloads only read
files that resolve under --allowed-weight-roots.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Strict, create_model

from rollout.control import ControlCall
from rollout.errors import InvalidRequest
from rollout.weight_sync import calls
from rollout.weight_sync.tensor_handles import TensorHandles

if TYPE_CHECKING:
    from rollout.engine.engine import RolloutEngine

router = APIRouter()


def _body(name: str, call: type[ControlCall], **fields: Any) -> type[BaseModel]:
    """The JSON body of `call`: its fields with their types and defaults, nothing else
    (`fields` gives a field another JSON type, or None: not in the body). Only the types are
    checked here; the call checks the values where the engine builds it."""
    hints = typing.get_type_hints(call)
    defaults = {
        f.name: (_strict(hints[f.name]), ... if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(call)
    }
    for field, kind in fields.items():
        if kind is None:
            del defaults[field]
        else:
            defaults[field] = (kind, defaults[field][1])
    return create_model(name, __config__=ConfigDict(extra="forbid"), **defaults)


def _strict(kind: Any) -> Any:
    """`kind` with its bool, int, float and str parts taken as sent, in optional fields and in
    tuples too: "yes" is no bool, "5" no int, "30" no float, [["4"]] no shape. A JSON list
    still makes a tuple."""
    if kind in (bool, int, float, str):
        return Annotated[kind, Strict()]
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_strict(a) for a in args)]  # noqa: UP007 - built from a tuple
    if origin is tuple:
        return tuple[tuple(a if a is Ellipsis else _strict(a) for a in args)]
    return kind


InitGroupBody = _body("InitGroupBody", calls.InitWeightsUpdateGroup)
GroupBody = _body("GroupBody", calls.DestroyWeightsUpdateGroup)
DistributedBody = _body("DistributedBody", calls.UpdateWeightsFromDistributed)
# load_format: how the sender gave the tensors (None or flattened_bucket, checked as the Python
# API's argument is); the handles carry the layout, so both load the same way.
# tensor_handles: one set of handles for every tensor-parallel rank, or a list of one per rank;
# or SGLang's serialized_named_tensors: base64 pickles, one per rank (restricted unpickler).
TensorBody = _body(
    "TensorBody",
    calls.UpdateWeightsFromTensor,
    tensor_handles=dict[str, Any] | list[dict[str, Any]] | None,
    serialized_named_tensors=list[str] | None,
)
DiskBody = _body("DiskBody", calls.UpdateWeightsFromDisk, allowed_roots=None)  # the server's
WeightsByNameBody = _body("WeightsByNameBody", calls.GetWeightsByName)
VersionBody = _body("VersionBody", calls.UpdateWeightVersion)
PauseBody = _body("PauseBody", calls.PauseGeneration)
TagsBody = _body("TagsBody", calls.ReleaseMemoryOccupation)


def _engine(request: Request) -> RolloutEngine:
    return request.app.state.engine


def _dict(result: Any) -> dict:
    """The JSON answer: the engine's whole result (its `info` where the Python API answers
    with SGLang's tuple)."""
    return dict(getattr(result, "info", result))


@router.post("/init_weights_update_group")
def init_weights_update_group(body: InitGroupBody, request: Request) -> dict:
    return _dict(_engine(request).init_weights_update_group(**body.model_dump()))


@router.post("/destroy_weights_update_group")
def destroy_weights_update_group(body: GroupBody, request: Request) -> dict:
    return _dict(_engine(request).destroy_weights_update_group(body.group_name))


@router.post("/update_weights_from_distributed")
def update_weights_from_distributed(body: DistributedBody, request: Request) -> dict:
    return _dict(_engine(request).update_weights_from_distributed(**body.model_dump()))


@router.post("/update_weights_from_tensor")
def update_weights_from_tensor(body: TensorBody, request: Request) -> dict:
    given = body.tensor_handles
    if body.serialized_named_tensors is not None:
        if given is not None:
            raise InvalidRequest("give exactly one of tensor_handles and serialized_named_tensors")
        given = body.serialized_named_tensors
    elif isinstance(given, list):
        given = [TensorHandles.from_json(h) for h in given]
    elif given is not None:
        given = TensorHandles.from_json(given)
    else:
        raise InvalidRequest("give tensor_handles or serialized_named_tensors")
    return _dict(
        _engine(request).update_weights_from_tensor(
            given, body.load_format, body.flush_cache, body.weight_version,
            lora_name=body.lora_name, abort_all_requests=body.abort_all_requests,
        )
    )  # fmt: skip


@router.post("/update_weights_from_disk")
def update_weights_from_disk(body: DiskBody, request: Request) -> dict:
    roots = request.app.state.options.allowed_weight_roots
    # The roots go with the call: the scheduler checks the path, and every file (config, index,
    # each shard) where it opens it, so neither a symlink nor an index naming files elsewhere
    # gets out; and a path refused there drops what a paused engine has staged, as any refusal.
    return _dict(
        _engine(request).update_weights_from_disk(
            body.model_path, body.load_format, body.weight_version, allowed_roots=list(roots),
            flush_cache=body.flush_cache, abort_all_requests=body.abort_all_requests,
            lora_name=body.lora_name,
        )
    )  # fmt: skip


@router.post("/get_weights_by_name")
def get_weights_by_name(body: WeightsByNameBody, request: Request) -> list:
    return _engine(request).get_weights_by_name(body.name, body.truncate_size)


@router.get("/get_weights_by_name")
def get_weights_by_name_query(request: Request, name: str, truncate_size: int = 100) -> list:
    """As the POST, with the arguments in the query string (SGLang's clients send GET)."""
    return _engine(request).get_weights_by_name(name, truncate_size)


@router.get("/get_weight_version")
def get_weight_version(request: Request) -> dict:
    return {"weight_version": _engine(request).get_weight_version()}


@router.post("/update_weight_version")
def update_weight_version(body: VersionBody, request: Request) -> dict:
    return _engine(request).update_weight_version(body.new_version, body.abort_all_requests)


@router.post("/pause_generation")
def pause_generation(request: Request, body: PauseBody | None = None) -> dict:
    return _engine(request).pause_generation((body or PauseBody()).mode)  # AReaL sends no body


@router.post("/continue_generation")
def continue_generation(request: Request) -> dict:
    return _engine(request).continue_generation()


@router.post("/release_memory_occupation")
def release_memory_occupation(body: TagsBody, request: Request) -> dict:
    return _engine(request).release_memory_occupation(body.tags)


@router.post("/resume_memory_occupation")
def resume_memory_occupation(body: TagsBody, request: Request) -> dict:
    return _engine(request).resume_memory_occupation(body.tags)


@router.post("/discard_staged_weights")
def discard_staged_weights(request: Request) -> dict:
    return _engine(request).discard_staged_weights()
