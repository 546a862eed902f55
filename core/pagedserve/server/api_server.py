"""The OpenAI-compatible HTTP API (FastAPI) in front of an `AsyncLLMEngine`.

Routes: POST /v1/completions (`completions.py`), POST /v1/chat/completions (`chat.py`), both
streaming as server-sent events ending with `data: [DONE]`; POST /v1/embeddings (`embeddings.py`);
POST /v1/score and /v1/rerank (`scoring.py`, vLLM's cross-encoder scoring; also /score,
/rerank and /v2/rerank); POST /v1/responses and GET /v1/responses/{id} (`responses.py`, OpenAI's
Responses API over the chat path); GET /v1/models, /v1/models/{id}, /health, /version, /metrics;
POST /tokenize and /detokenize (`tokenization.py`). Every error is OpenAI's JSON shape
`{"error": {"message", "type", "param", "code"}}`: bad input is 400 naming the field, an unknown
model 404, a wrong API key 401, a body over the limit 413 (`guards.py`), a dead engine 503. Bad
input never reaches a 500. CPU work (tokenizing, chat templates, grammars) runs off the event
loop, so /health answers while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
from pagedserve.server.async_engine import AsyncLLMEngine
from pagedserve.server.chat import ChatHandler
from pagedserve.server.completions import CompletionsHandler
from pagedserve.server.embeddings import EmbeddingsHandler
from pagedserve.server.errors import APIError, error_response, validation_api_error
from pagedserve.server.guards import ApiKeyGuard, BodyLimit
from pagedserve.server.handlers import ServerConfig
from pagedserve.server.metrics import CONTENT_TYPE
from pagedserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from pagedserve.server.responses import ResponsesHandler
from pagedserve.server.responses_protocol import ResponsesRequest
from pagedserve.server.responses_store import ResponseStore
from pagedserve.server.scoring import ScoringHandler
from pagedserve.server.scoring_protocol import RerankRequest, ScoreRequest
from pagedserve.server.tokenization import DetokenizeRequest, TokenizationHandler, TokenizeRequest

__all__ = ["APIError", "ServerConfig", "build_app"]


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`. Does not start or stop the engine."""
    app = FastAPI(title="pagedserve", version=pagedserve.__version__)
    created = int(time.time())
    completions_handler = CompletionsHandler(engine, config, created)
    chat_handler = ChatHandler(engine, config, created)
    embeddings_handler = EmbeddingsHandler(engine, config, created)
    scoring_handler = ScoringHandler(engine, config, created)
    responses_handler = ResponsesHandler(chat_handler, ResponseStore(config.max_stored_responses))
    tokenization = TokenizationHandler(chat_handler)
    _add_error_handlers(app)
    # The last added runs first: the key is checked before any body byte is counted.
    app.add_middleware(BodyLimit, max_bytes=config.max_request_body_bytes)
    if config.api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=config.api_key)
    _add_info_routes(app, engine, config, created, chat_handler.check_model)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await completions_handler(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_handler(body, request)

    @app.post("/v1/responses", response_model=None)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await responses_handler.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def response(response_id: str) -> dict[str, Any]:
        return responses_handler.retrieve(response_id)

    @app.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings_handler(body, request)

    @app.post("/v1/score", response_model=None)
    @app.post("/score", response_model=None, include_in_schema=False)  # vLLM's alias
    async def score(body: ScoreRequest, request: Request) -> Response:
        return await scoring_handler.score(body, request)

    @app.post("/v1/rerank", response_model=None)
    @app.post("/rerank", response_model=None, include_in_schema=False)  # vLLM's aliases
    @app.post("/v2/rerank", response_model=None, include_in_schema=False)
    async def rerank(body: RerankRequest, request: Request) -> Response:
        return await scoring_handler.rerank(body, request)

    @app.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeRequest) -> Response:
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await tokenization.detokenize(body)

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Answer every error (ours, request validation, routing) with the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), kind=kind))


def _add_info_routes(
    app: FastAPI,
    engine: AsyncLLMEngine,
    config: ServerConfig,
    created: int,
    check_model: Callable[[str | None], None],
) -> None:
    """Add the routes describing the server: health, version, metrics and the model list (the
    served model, then each LoRA adapter with its folder as `root` and its base as `parent`, as
    vLLM lists them)."""

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_reason or "the engine is not running"
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(config.served_model_name), media_type=CONTENT_TYPE)

    def card(model_id: str, root: str | None, parent: str | None) -> dict[str, Any]:
        return {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "pagedserve",
            "root": root,
            "parent": parent,
            "max_model_len": engine.max_model_len,
        }

    def cards() -> dict[str, dict[str, Any]]:
        """Model id -> its card: the served model first, then the adapters in flag order."""
        served = config.served_model_name
        found = {served: card(served, engine.args.model, None)}
        for module in config.lora_modules:
            found[module.name] = card(module.name, module.path, module.base_model_name or served)
        return found

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": list(cards().values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)  # the 404 the generation routes give for an unknown model
        return cards()[model_id]
