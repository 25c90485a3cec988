"""The FastAPI app: SGLang-native and OpenAI-compatible routes over one RolloutEngine.

Every error is a JSON body `{"error": {"message", "type", "code"}}` with a 4xx status for bad
input, 503 when the engine is gone; a bug shows as 500 but never takes the server down.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from rollout.engine.tokenizer_manager import EngineDeadError
from rollout.server.guard import BodyTooLarge, Guard
from rollout.server.metrics import ServerMetrics
from rollout.server.options import ServerOptions
from rollout.server.responses import JSON, error

logger = logging.getLogger(__name__)


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        if e.get("type") == "json_invalid":
            return "the request body is not valid JSON"
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {e.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def create_app(engine: Any, options: ServerOptions) -> FastAPI:
    from rollout.server.embeddings_api import router as embeddings_router
    from rollout.server.native import router as native_router
    from rollout.server.openai_api import router as openai_router
    from rollout.server.weights_api import router as weights_router
    from rollout.server.weights_api import weight_sync_error
    from rollout.weight_sync.update_group import WeightSyncError

    app = FastAPI(title="rollout", version="0.1.0", default_response_class=JSON)
    app.state.engine = engine
    app.state.options = options
    app.state.metrics = ServerMetrics()
    app.state.started = int(time.time())
    app.state.model_name = options.served_model_name or engine.options.model.model_path
    app.include_router(native_router)
    app.include_router(openai_router)
    app.include_router(weights_router)
    app.include_router(embeddings_router)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSON:
        return error(400, _describe(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSON:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> JSON:
        return error(413, str(exc))

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def _bad_value(request: Request, exc: Exception) -> JSON:
        return error(400, str(exc))

    @app.exception_handler(WeightSyncError)
    async def _sync_failed(request: Request, exc: WeightSyncError) -> JSON:
        return weight_sync_error(str(exc))

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSON:
        return error(503, f"the engine is not serving: {exc}", "server_error")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSON:
        logger.exception("unhandled error in %s", request.url.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    app.add_middleware(Guard, options=options)
    return app
