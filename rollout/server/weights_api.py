"""Weight-sync and memory endpoints, SGLang's names and payloads (admin-only: see guard.py).

Tensor handoff over HTTP takes `tensor_handles`, the JSON form of rollout.weight_sync's
TensorHandles (names, dtypes, shapes, CUDA IPC handles or shared-memory block names): nothing
that arrives here is unpickled. Disk reloads only read files that resolve under
--allowed-weight-roots.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from rollout.server.responses import JSON, error
from rollout.weight_sync.calls import DEFAULT_GROUP
from rollout.weight_sync.tensor_handles import TensorHandles

router = APIRouter()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InitGroupBody(_Body):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"
    timeout_s: float | None = None


class GroupBody(_Body):
    group_name: str = DEFAULT_GROUP


class DistributedBody(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    weight_version: str | None = None
    load_format: str | None = None


class TensorBody(_Body):
    tensor_handles: dict[str, Any]
    load_format: str | None = None  # accepted for SGLang's payload shape; handles carry the layout
    flush_cache: bool = True
    weight_version: str | None = None


class DiskBody(_Body):
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None


class WeightsByNameBody(_Body):
    name: str
    truncate_size: int = 100


class VersionBody(_Body):
    new_version: str
    abort_all_requests: bool = False


class PauseBody(_Body):
    mode: str = "abort"


class TagsBody(_Body):
    tags: list[str] | None = None


def _engine(request: Request) -> Any:
    return request.app.state.engine


@router.post("/init_weights_update_group")
def init_weights_update_group(body: InitGroupBody, request: Request) -> dict:
    return _engine(request).init_weights_update_group(**body.model_dump())


@router.post("/destroy_weights_update_group")
def destroy_weights_update_group(body: GroupBody, request: Request) -> dict:
    return _engine(request).destroy_weights_update_group(body.group_name)


@router.post("/update_weights_from_distributed")
def update_weights_from_distributed(body: DistributedBody, request: Request) -> dict:
    return _engine(request).update_weights_from_distributed(**body.model_dump())


@router.post("/update_weights_from_tensor")
def update_weights_from_tensor(body: TensorBody, request: Request) -> dict:
    handles = TensorHandles.from_json(body.tensor_handles)
    return _engine(request).update_weights_from_tensor(
        handles, flush_cache=body.flush_cache, weight_version=body.weight_version
    )


@router.post("/update_weights_from_disk")
def update_weights_from_disk(body: DiskBody, request: Request) -> Any:
    roots = request.app.state.options.allowed_weight_roots
    path = os.path.realpath(body.model_path)
    if not any(os.path.commonpath([path, os.path.realpath(r)]) == os.path.realpath(r) for r in roots):
        allowed = ", ".join(roots) if roots else "none configured (start with --allowed-weight-roots DIR)"
        return error(403, f"model_path {body.model_path!r} is not under an allowed root: {allowed}", "permission_error")
    # The roots go with the call: the scheduler checks every file (config, index, each shard)
    # where it opens it, so neither a symlink nor an index naming files elsewhere gets out.
    try:
        return _engine(request).update_weights_from_disk(
            path, body.load_format, body.weight_version, allowed_roots=list(roots)
        )
    except PermissionError as e:
        return error(403, str(e), "permission_error")


@router.post("/get_weights_by_name")
def get_weights_by_name(body: WeightsByNameBody, request: Request) -> list:
    return _engine(request).get_weights_by_name(body.name, body.truncate_size)


@router.get("/get_weight_version")
def get_weight_version(request: Request) -> dict:
    return {"weight_version": _engine(request).get_weight_version()}


@router.post("/update_weight_version")
def update_weight_version(body: VersionBody, request: Request) -> dict:
    return _engine(request).update_weight_version(body.new_version, body.abort_all_requests)


@router.post("/pause_generation")
def pause_generation(body: PauseBody, request: Request) -> dict:
    return _engine(request).pause_generation(body.mode)


@router.post("/continue_generation")
def continue_generation(request: Request) -> dict:
    return _engine(request).continue_generation()


@router.post("/release_memory_occupation")
def release_memory_occupation(body: TagsBody, request: Request) -> dict:
    return _engine(request).release_memory_occupation(body.tags)


@router.post("/resume_memory_occupation")
def resume_memory_occupation(body: TagsBody, request: Request) -> dict:
    return _engine(request).resume_memory_occupation(body.tags)


def weight_sync_error(message: str) -> JSON:
    """A transfer that failed (peer gone, timeout): the update did not apply; the old weights serve."""
    return error(502, message, "weight_sync_error")
