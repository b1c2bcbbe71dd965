"""The frontend's HTTP routes: OpenAI's API, vLLM's extras, metrics and the dashboard.

| route | key | what |
| --- | --- | --- |
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | user | generation, JSON or SSE |
| ``GET /v1/models`` | user | the served model |
| ``POST /tokenize``, ``POST /detokenize`` | user | vLLM's shapes |
| ``GET /health`` | none | 200 while it can serve; 503 while starting, draining, or without scheduler or worker |
| ``GET /version`` | none | kvmesh's version |
| ``GET /metrics`` | admin | Prometheus text format |
| ``GET /stats`` | admin | the dashboard's JSON (see ``dashboard.py``) |
| ``GET /dashboard`` | none | the page; it sends the key from ``#key=...`` |

Keys apply only when configured (``auth.py``). Every request goes through
the same AsyncLLM and validation as the gRPC API; errors are OpenAI's error
object (``errors.py``).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.sampling_params import SamplingParams
from services.frontend.async_llm import AsyncLLM, RequestFailedError
from services.frontend.auth import ApiKeyAuth, AuthError, Role
from services.frontend.config import ModelInfo
from services.frontend.engine_core_client import EngineCoreClient
from services.frontend.http.dashboard import DASHBOARD_PAGE, STATIC_DIR, cluster_stats_to_json
from services.frontend.http.errors import HTTPError, error_body, error_response
from services.frontend.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)
from services.frontend.http.responses import ChatFormat, CompletionFormat, ResponseBuilder
from services.frontend.http.sampling import chat_inputs, chat_messages, completion_inputs
from services.frontend.http.serving import Generation, serve_generation
from services.frontend.http.streaming import ClientDisconnectedError
from services.frontend.http.chat_reasoning import ChatReasoning, constrain_after_reasoning
from services.frontend.input_processor import PromptType
from services.frontend.reasoning import ReasoningParser
from services.frontend.tool_parsers import ToolParser, get_tool_parser
from services.common.validation import ValidationError, check_token_ids

# What nginx logs for a client that closed the connection first; nobody reads it.
_CLIENT_CLOSED_REQUEST = 499


class EngineSource(Protocol):
    """Where the frontend's engine is once loaded (the gRPC servicer holds it)."""

    engine: AsyncLLM | None
    model_info: ModelInfo | None
    engine_core: EngineCoreClient | None


@dataclass(slots=True)
class HttpState:
    """What the routes serve from. /health says 200 only while ``cluster_serving``
    (the frontend's health check: scheduler stream up, scheduler answering, a
    worker registered) and not ``draining``."""

    source: EngineSource
    auth: ApiKeyAuth
    # Reads tool calls in free answers (tool_choice "auto").
    tool_parser: ToolParser = field(default_factory=lambda: get_tool_parser("hermes"))
    # Splits reasoning from content in chat answers; None: no reasoning parser.
    reasoning_parser: ReasoningParser | None = None
    draining: bool = False
    cluster_serving: bool = False
    started: int = field(default_factory=lambda: int(time.time()))

    def ready(self) -> tuple[AsyncLLM, ModelInfo]:
        source = self.source
        if source.engine is None or source.model_info is None:
            raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE, "the frontend is still starting")
        return source.engine, source.model_info

    def serving(self) -> bool:
        return self.cluster_serving and not self.draining


def _state(request: Request) -> HttpState:
    return request.app.state.http


def _require(role: Role) -> Callable[[Request], Awaitable[str | None]]:
    # async: FastAPI would run a plain function in a thread pool.
    async def check_key(request: Request) -> str | None:
        return _state(request).auth.check(request.headers.get("authorization"), role)
    return check_key


UserKey = Annotated[str | None, Depends(_require(Role.USER))]
AdminKey = Annotated[str | None, Depends(_require(Role.ADMIN))]


def _check_model(model: str | None, info: ModelInfo) -> None:
    if model is not None and model != info.name:
        raise HTTPError(HTTPStatus.NOT_FOUND, f"The model '{model}' does not exist; this server "
                        f"serves '{info.name}'.", param="model", code="model_not_found")


def _request_id(raw_request: Request) -> str:
    return raw_request.headers.get("x-request-id") or secrets.token_hex(16)


def _generation(state: HttpState, key: str | None, request: SamplingRequest, request_id: str,
                prompt: PromptType, params: SamplingParams) -> Generation:
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    return Generation(request_id, prompt, params, request.priority,
                      state.auth.cache_salt(key, request.cache_salt), include_usage)


def build_app(state: HttpState) -> FastAPI:
    """The app; its routes read ``state`` (``app.state.http``)."""
    app = FastAPI(title="kvmesh", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.http = state
    _add_error_handlers(app)
    _add_generation_routes(app)
    _add_info_routes(app)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    return app


def _add_generation_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request,
                                key: UserKey) -> Response:
        state = _state(raw_request)
        engine, info = state.ready()
        _check_model(request.model, info)
        request_id = _request_id(raw_request)
        prompt, params = completion_inputs(request)
        builder = ResponseBuilder(CompletionFormat(params.logprobs), request_id, info.name,
                                  request.return_token_ids)
        return await serve_generation(
            raw_request, engine, _generation(state, key, request, request_id, prompt, params),
            builder, {"X-Request-Id": request_id})

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request,
                                     key: UserKey) -> Response:
        state = _state(raw_request)
        engine, info = state.ready()
        _check_model(request.model, info)
        request_id = _request_id(raw_request)
        messages, params, tool_calls = chat_inputs(request, state.tool_parser)
        reasoning = None
        if state.reasoning_parser is not None:
            constrain_after_reasoning(params, state.reasoning_parser,
                                      engine.input_processor.tokenizer)
            reasoning = ChatReasoning(state.reasoning_parser)
        builder = ResponseBuilder(ChatFormat(params.logprobs, tool_calls, reasoning), request_id,
                                  info.name, request.return_token_ids)
        generation = _generation(state, key, request, request_id, messages, params)
        try:
            return await serve_generation(raw_request, engine, generation, builder,
                                          {"X-Request-Id": request_id})
        except ValidationError as e:
            if e.field == "max_tokens" and request.max_completion_tokens is not None:
                raise ValidationError("max_completion_tokens",
                                      str(e).replace("max_tokens", "max_completion_tokens")) from e
            raise


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/v1/models")
    async def show_models(raw_request: Request, key: UserKey) -> dict[str, Any]:
        state = _state(raw_request)
        _, info = state.ready()
        return {"object": "list", "data": [{
            "id": info.name, "object": "model", "created": state.started, "owned_by": "kvmesh",
            "root": info.name, "max_model_len": info.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize_prompt(request: TokenizeRequest, raw_request: Request,
                              key: UserKey) -> dict[str, Any]:
        engine, info = _state(raw_request).ready()
        _check_model(request.model, info)
        if (request.prompt is None) == (request.messages is None):
            raise ValidationError("prompt", "give exactly one of prompt or messages")
        prompt = request.prompt if request.prompt is not None else chat_messages(request.messages)
        token_ids = await asyncio.to_thread(
            engine.input_processor.tokenize, prompt,
            add_special_tokens=request.add_special_tokens,
            add_generation_prompt=request.add_generation_prompt)
        return {"count": len(token_ids), "max_model_len": info.max_model_len, "tokens": token_ids}

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest, raw_request: Request,
                         key: UserKey) -> dict[str, Any]:
        engine, info = _state(raw_request).ready()
        _check_model(request.model, info)
        check_token_ids("tokens", request.tokens, info.vocab_size)
        text = engine.input_processor.tokenizer.decode(
            request.tokens, skip_special_tokens=request.skip_special_tokens)
        return {"prompt": text}

    @app.get("/health")
    async def health(raw_request: Request) -> Response:
        serving = _state(raw_request).serving()
        return Response(status_code=HTTPStatus.OK if serving else HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        try:
            return {"version": importlib.metadata.version("kvmesh")}
        except importlib.metadata.PackageNotFoundError:  # a source tree, not installed
            return {"version": "unknown"}

    @app.get("/metrics")
    async def metrics(raw_request: Request, key: AdminKey) -> Response:
        engine = _state(raw_request).source.engine
        body = b""
        if engine is not None and engine.stat_logger is not None:
            body = generate_latest(engine.stat_logger.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats(raw_request: Request, key: AdminKey) -> dict[str, Any]:
        state = _state(raw_request)
        _, info = state.ready()
        core = state.source.engine_core
        try:
            cluster = await core.get_stats(include_block_map=True)
        except Exception as e:  # grpc.aio.AioRpcError: the scheduler is unreachable
            raise HTTPError(HTTPStatus.SERVICE_UNAVAILABLE,
                            f"the scheduler's GetStats failed: {e}") from e
        return cluster_stats_to_json(cluster, info.name)

    @app.get("/dashboard")
    async def dashboard() -> FileResponse:
        return FileResponse(DASHBOARD_PAGE, media_type="text/html")


def _add_error_handlers(app: FastAPI) -> None:
    async def openai_error(request: Request, exc: Exception) -> Response:
        return error_response(exc)

    # Exception: a bug answers 500 in the same shape (and is logged by Starlette).
    for exc_type in (HTTPError, ValidationError, RequestFailedError, AuthError, Exception):
        app.add_exception_handler(exc_type, openai_error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # The first error; ``param`` is the top-level field, as OpenAI names it,
        # the message the whole path (a union's member types included).
        error = exc.errors()[0]
        loc = [str(part) for part in error["loc"] if part != "body"]
        message = f"{'.'.join(loc) or 'body'}: {error['msg']}"
        if loc and error["type"] != "missing":
            message += f", got {error['input']!r}"
        return JSONResponse(error_body(HTTPStatus.BAD_REQUEST, message, loc[0] if loc else None),
                            status_code=HTTPStatus.BAD_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(status, message), status_code=status)

    @app.exception_handler(ClientDisconnectedError)
    async def client_left(request: Request, exc: ClientDisconnectedError) -> Response:
        return Response(status_code=_CLIENT_CLOSED_REQUEST)
