"""OpenAI's /v1/models: the served model, and "<model>:<adapter>" for each loaded LoRA adapter."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from rollout.server.responses import error

router = APIRouter()


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "rollout", "root": name}


@router.get("/v1/models")
def list_models(request: Request) -> dict:
    """The served model, and "<model>:<adapter>" for each loaded LoRA adapter."""
    name, started = request.app.state.model_name, request.app.state.started
    engine, adapters = request.app.state.engine, {}
    if engine.options.lora.enable_lora:  # a control call: only where adapters can be loaded
        adapters = engine.get_server_info().get("lora_adapters") or {}
    cards = [_model_card(name, started)]
    for adapter in sorted(adapters):
        cards.append({**_model_card(f"{name}:{adapter}", started), "root": name, "parent": name})
    return {"object": "list", "data": cards}


@router.get("/v1/models/{model_id:path}")
def get_model(model_id: str, request: Request) -> Any:
    card = next((c for c in list_models(request)["data"] if c["id"] == model_id), None)
    if card is None:
        return error(404, f"model {model_id!r} is not served here", "model_not_found")
    return card
