"""LoRA adapter endpoints, SGLang's names and payloads (admin-only: see guard.py):
`POST /load_lora_adapter {"lora_name", "lora_path"}` and `POST /unload_lora_adapter
{"lora_name"}`. A load reads only files under --allowed-weight-roots."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from pydantic import BaseModel

from rollout.server.json_body import BODY_CONFIG
from rollout.weight_sync.weight_roots import path_under_roots

if TYPE_CHECKING:
    from rollout.engine.engine import RolloutEngine

router = APIRouter()


class LoadLoraBody(BaseModel):
    model_config = BODY_CONFIG
    lora_name: str
    lora_path: str
    pinned: bool = False  # SGLang's: every loaded adapter stays until unloaded here


class UnloadLoraBody(BaseModel):
    model_config = BODY_CONFIG
    lora_name: str


def _engine(request: Request) -> RolloutEngine:
    return request.app.state.engine


@router.post("/load_lora_adapter")
def load_lora_adapter(body: LoadLoraBody, request: Request) -> dict:
    roots = request.app.state.options.allowed_weight_roots
    path = path_under_roots(body.lora_path, roots, "lora_path")
    return _engine(request).load_lora_adapter(body.lora_name, path, allowed_roots=list(roots))


@router.post("/unload_lora_adapter")
def unload_lora_adapter(body: UnloadLoraBody, request: Request) -> dict:
    return _engine(request).unload_lora_adapter(body.lora_name)
