"""The FastAPI app: SGLang-native and OpenAI-compatible routes over one RolloutEngine.

Every error is a JSON body `{"error": {"message", "type", "code"}}`: a 4xx status only for
what the caller got wrong (a body that doesn't fit the route's schema, or a RequestError of
the project's validation: rollout/errors.py), 502 for a failed weight transfer, 503 when the
engine is gone; anything else is a bug, a 500 that never takes the server down. No answer
carries a traceback or a file path: a 500 names an error id, logged with the trace (see
responses.describe_failure, the one table from exception to answer).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from rollout.engine.tokenizer_manager import EngineDeadError
from rollout.errors import RequestError, WeightSyncError
from rollout.server.guard import Guard
from rollout.server.json_body import describe_validation_errors
from rollout.server.metrics import DISCONNECT_STATUS, CountErrors, ServerMetrics
from rollout.server.options import ServerOptions
from rollout.server.request_owners import RequestOwners
from rollout.server.responses import JSON, RequestFailedError, error, failure
from rollout.server.streaming import ClientDisconnected

if TYPE_CHECKING:  # a stand-in with the same methods serves too (tests)
    from rollout.engine.engine import RolloutEngine


def create_app(engine: RolloutEngine, options: ServerOptions) -> FastAPI:
    from rollout.server.embeddings_api import router as embeddings_router
    from rollout.server.lora_api import router as lora_router
    from rollout.server.models_api import router as models_router
    from rollout.server.native import router as native_router
    from rollout.server.openai_api import router as openai_router
    from rollout.server.responses_api import router as responses_router
    from rollout.server.weights_api import router as weights_router

    app = FastAPI(title="rollout", version="0.1.0", default_response_class=JSON)
    app.state.engine = engine
    app.state.options = options
    app.state.started = int(time.time())
    app.state.model_name = options.served_model_name or engine.options.model.model_path
    app.state.owners = RequestOwners()
    app.state.stopping = False  # set by the server process on shutdown: see Guard
    app.include_router(native_router)
    app.include_router(openai_router)
    app.include_router(weights_router)
    app.include_router(lora_router)
    app.include_router(models_router)
    app.include_router(embeddings_router)
    app.include_router(responses_router)
    app.state.metrics = ServerMetrics(routes=app.openapi()["paths"])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSON:
        return error(400, describe_validation_errors(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSON:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=DISCONNECT_STATUS)  # nobody reads it; /metrics counts it

    # The project's own types are answered where they are raised (ExceptionMiddleware); any
    # other exception, a bug, reaches Starlette's ServerErrorMiddleware, which answers through
    # the same handler.
    @app.exception_handler(RequestError)
    @app.exception_handler(WeightSyncError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestFailedError)
    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> JSON:
        return failure(exc, request.url.path)

    app.add_middleware(Guard, options=options, state=app.state)
    app.add_middleware(CountErrors, metrics=app.state.metrics)  # outermost: sees Guard's answers
    return app
