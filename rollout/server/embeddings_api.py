"""Embedding, reward and scoring endpoints: SGLang's /encode and /classify, OpenAI's
/v1/embeddings, and /v1/score and /v1/rerank. encode, classify, embeddings and rerank need a
server started with --is-embedding; score needs a causal LM."""

from __future__ import annotations

import base64
import struct
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, SkipValidation

from rollout.server.json_body import BODY_CONFIG, OffLoopRoute
from rollout.server.native import Prompts, TokenIds
from rollout.server.responses import check_model, error, json_response
from rollout.server.streaming import until_disconnect

if TYPE_CHECKING:
    from rollout.engine.engine import RolloutEngine

router = APIRouter(route_class=OffLoopRoute)  # large bodies parsed off the event loop

Prompt = Prompts  # checked by the engine, off the event loop (see native.py)
Ids = TokenIds
# A prompt as text or ids, or a list of them: checked by the engine (see native.py).
AnyPrompts = SkipValidation[str | list[str] | list[int] | list[list[int]]]


class EncodeRequest(BaseModel):
    model_config = BODY_CONFIG

    text: Prompt = None
    input_ids: Ids = None
    normalize: bool = False
    rid: str | list[str] | None = None


class ClassifyRequest(BaseModel):
    model_config = BODY_CONFIG

    text: Prompt = None
    input_ids: Ids = None
    messages: list[dict[str, Any]] | list[list[dict[str, Any]]] | None = None
    rid: str | list[str] | None = None


class EmbeddingsRequest(BaseModel):
    # Unknown fields ignored: OpenAI clients send user, dimensions, ...
    model_config = ConfigDict({**BODY_CONFIG, "extra": "ignore"})

    input: AnyPrompts
    model: str
    encoding_format: str = "float"


class ScoreRequest(BaseModel):
    model_config = BODY_CONFIG

    query: SkipValidation[str | list[int]]
    items: AnyPrompts
    label_token_ids: list[int]
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


class RerankRequest(BaseModel):
    model_config = BODY_CONFIG

    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True
    model: str | None = None


def _engine(request: Request) -> Any:
    return request.app.state.engine




async def _owned(request: Request, rid: str | list[str] | None, work: Awaitable[Any]) -> Any:
    """Awaits work (until the client disconnects), its rids owned by the caller's key while it
    runs, so that this key can abort them (see /abort_request)."""
    with request.app.state.owners.claim(rid, request.state.role):
        return await until_disconnect(request, work)


@router.post("/encode")
async def encode(body: EncodeRequest, request: Request) -> Any:
    work = _engine(request).async_encode(body.text, body.input_ids, body.normalize, body.rid)
    return await json_response(await _owned(request, body.rid, work))


@router.post("/classify")
async def classify(body: ClassifyRequest, request: Request) -> Any:
    work = _engine(request).async_classify(body.text, body.input_ids, body.messages, body.rid)
    return await json_response(await _owned(request, body.rid, work))


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request) -> Any:
    if (bad := check_model(request, body.model)) is not None:
        return bad
    if body.encoding_format not in ("float", "base64"):
        return error(400, f"encoding_format must be float or base64, got {body.encoding_format!r}")
    data = body.input
    is_ids = isinstance(data, list) and bool(data) and not isinstance(data[0], str)
    kwargs = {"input_ids": data} if is_ids else {"prompt": data}
    outs = await until_disconnect(request, _engine(request).async_encode(**kwargs))
    outs = outs if isinstance(outs, list) else [outs]
    tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    return await json_response({
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": _encoded(o["embedding"], body.encoding_format)}
            for i, o in enumerate(outs)
        ],
        "model": request.app.state.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })  # fmt: skip


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    # base64: the little-endian float32 bytes, what OpenAI's client asks for by default.
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request) -> Any:
    if body.model is not None and (bad := check_model(request, body.model)) is not None:
        return bad
    work = _engine(request).async_score(
        body.query, body.items, body.label_token_ids, body.apply_softmax, body.item_first
    )
    scores = await until_disconnect(request, work)
    return await json_response(
        {"object": "scoring", "model": request.app.state.model_name, "scores": scores}
    )


@router.post("/v1/rerank")
async def rerank(body: RerankRequest, request: Request) -> Any:
    """Documents by relevance to the query, highest first. A classifier (cross-encoder) scores
    each (query, document) pair, tokenized as a pair, by its first output; a causal-LM embedder
    by the cosine similarity of the normalized last-token embeddings."""
    if body.model is not None and (bad := check_model(request, body.model)) is not None:
        return bad
    if not body.documents:
        return error(400, "documents must be a non-empty list of str")
    if body.top_n is not None and body.top_n < 1:
        return error(400, f"top_n must be >= 1, got {body.top_n}")
    scores = await until_disconnect(
        request, relevance(_engine(request), body.query, body.documents)
    )
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n]
    results = []
    for i in order:
        entry: dict[str, Any] = {"index": i, "score": scores[i]}
        if body.return_documents:
            entry["document"] = body.documents[i]
        results.append(entry)
    return results


async def relevance(engine: RolloutEngine, query: str, documents: list[str]) -> list[float]:
    if engine.is_classifier:
        pairs = await engine.run_in_worker(_pair_ids, engine, query, documents)
        outs = await engine.async_classify(input_ids=pairs)
        return [o["embedding"][0] for o in outs]
    outs = await engine.async_encode([query, *documents], normalize=True)
    q = outs[0]["embedding"]
    return [sum(a * b for a, b in zip(q, o["embedding"])) for o in outs[1:]]


def _pair_ids(engine: RolloutEngine, query: str, documents: list[str]) -> list[list[int]]:
    """The cross-encoder's input ids of each (query, document) pair. A tokenizer call: on the
    engine's worker threads, each pair first checked to fit the context (as a prompt is)."""
    for i, doc in enumerate(documents):
        engine.limits.check_text([query, doc], f"the query with document {i}")
    return [engine.tokenizer(query, doc)["input_ids"] for doc in documents]
