"""The frontend gRPC service: the public ``kvmesh.v1.Generation`` API, and beside it
the HTTP API (services/frontend/http) on the same event loop and AsyncLLM.

Start-up order: listen at once with health NOT_SERVING, load the tokenizer,
open one FrontendStream to each scheduler (cell, engine_cells.py), then
report SERVING once a scheduler answers and has a worker. Health is
NOT_SERVING while no cell can serve (streams down, schedulers not answering
or without workers), and while draining. Status codes: INVALID_ARGUMENT for a bad request (the message
names the field and its allowed range), UNAVAILABLE when no scheduler or
worker can serve, RESOURCE_EXHAUSTED when the scheduler's queue is full,
UNAUTHENTICATED / PERMISSION_DENIED when API keys are on (auth.py).

``python -m services.frontend.server --port 50051 --scheduler-address HOST:PORT[,HOST:PORT...]``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import secrets
from contextlib import aclosing

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvmesh.v1 import api_pb2, api_pb2_grpc

from services.common.model_files import resolve_model_dir
from services.common.process import configure_logging, wait_for_shutdown_signal
from services.common.rpc import LIVENESS_SERVICE, SERVER_OPTIONS, DecodeErrorInterceptor
from services.common.scheduler_addresses import parse_scheduler_addresses
from services.common.security import (
    add_security_args,
    bind,
    read_cluster_secret,
    read_redis_url,
    tls_from_args,
)
from services.frontend import api_convert
from services.frontend.async_llm import AsyncLLM, RequestFailedError
from services.frontend.auth import ApiKeyAuth, AuthError, Role, parse_api_keys
from services.frontend.chat_templates import load_chat_template
from services.frontend.config import FrontendServiceConfig, ModelInfo, read_model_info
from services.frontend.engine_cells import EngineCells
from services.common.validation import (
    DEFAULT_MAX_LOGPROBS,
    RequestLimits,
    ValidationError,
    check_token_ids,
)
from services.frontend.http.app import HttpState, build_app
from services.frontend.http.server import HttpServer
from services.frontend.input_processor import InputProcessor, logits_processor_validators
from services.frontend.output_processor import OutputProcessor
from services.frontend.stat_logger import PrometheusStatLogger
from services.frontend.reasoning import REASONING_PARSER_NAMES, get_reasoning_parser
from services.frontend.tokenizer import load_eos_token_ids, load_tokenizer, longest_token_bytes
from services.frontend.tool_parsers import TOOL_PARSER_NAMES, get_tool_parser

logger = logging.getLogger(__name__)

GENERATION_SERVICE = api_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
_HEALTH_CHECK_INTERVAL_S = 1.0
# SmolLM2's tool-aware template (its own renders no tools).
DEFAULT_MODEL_CHAT_TEMPLATE = "smollm2_tools"
_AUTHORIZATION_METADATA_KEY = "authorization"


class GenerationServicer(api_pb2_grpc.GenerationServicer):
    """The public API over an AsyncLLM; answers UNAVAILABLE until ``ready``."""

    def __init__(self, auth: ApiKeyAuth | None = None) -> None:
        self.auth = auth or ApiKeyAuth()
        self.engine: AsyncLLM | None = None
        self.model_info: ModelInfo | None = None
        self.engine_core: EngineCells | None = None

    def ready(self, engine: AsyncLLM, model_info: ModelInfo, engine_core: EngineCells) -> None:
        self.engine, self.model_info, self.engine_core = engine, model_info, engine_core

    async def _authorize(self, context: grpc.aio.ServicerContext, role: Role) -> str | None:
        """The call's API key (None while keys are off); aborts the call without one."""
        metadata = dict(context.invocation_metadata() or ())
        try:
            return self.auth.check(metadata.get(_AUTHORIZATION_METADATA_KEY), role)
        except AuthError as e:
            code = (grpc.StatusCode.PERMISSION_DENIED if e.forbidden
                    else grpc.StatusCode.UNAUTHENTICATED)
            await context.abort(code, e.message)

    async def _engine(self, context: grpc.aio.ServicerContext) -> AsyncLLM:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the frontend is still starting")
        return self.engine

    async def Generate(self, request: api_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        key = await self._authorize(context, Role.USER)
        engine = await self._engine(context)
        client_request_id = request.request_id or f"req-{secrets.token_hex(8)}"
        try:
            prompt = api_convert.prompt_from_api(request)
            params = api_convert.sampling_params_from_api(
                request.sampling_params, request.HasField("sampling_params")
            )
            requested_salt = request.cache_salt if request.HasField("cache_salt") else None
            cache_salt = self.auth.cache_salt(key, requested_salt)
            stream = engine.generate(
                client_request_id, prompt, params, priority=request.priority, cache_salt=cache_salt
            )
            first = True
            async with aclosing(stream):
                async for output in stream:
                    yield api_convert.request_output_to_api(client_request_id, output, first=first)
                    first = False
        except ValidationError as e:
            logger.info("event=request_rejected request_id=%s field=%s message=%r",
                        client_request_id, e.field, str(e))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestFailedError as e:
            await context.abort(e.code, e.message)

    async def Tokenize(self, request: api_pb2.TokenizeRequest, context) -> api_pb2.TokenizeResponse:
        await self._authorize(context, Role.USER)
        engine = await self._engine(context)
        try:
            prompt = api_convert.prompt_from_api(request)
            ids = await asyncio.to_thread(engine.input_processor.tokenize, prompt,
                                          add_special_tokens=request.add_special_tokens)
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return api_pb2.TokenizeResponse(token_ids=ids)

    async def Detokenize(
        self, request: api_pb2.DetokenizeRequest, context
    ) -> api_pb2.DetokenizeResponse:
        await self._authorize(context, Role.USER)
        engine = await self._engine(context)
        try:
            check_token_ids("token_ids", request.token_ids, self.model_info.vocab_size)
        except ValidationError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        text = engine.input_processor.tokenizer.decode(
            list(request.token_ids), skip_special_tokens=request.skip_special_tokens
        )
        return api_pb2.DetokenizeResponse(text=text)

    async def GetModelInfo(
        self, request: api_pb2.GetModelInfoRequest, context
    ) -> api_pb2.ModelInfo:
        await self._authorize(context, Role.USER)
        await self._engine(context)
        info = self.model_info
        return api_pb2.ModelInfo(model=info.name, max_model_len=info.max_model_len,
                                 vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids)

    async def GetStats(self, request: api_pb2.GetStatsRequest, context) -> api_pb2.ClusterStats:
        await self._authorize(context, Role.ADMIN)
        await self._engine(context)
        try:
            return await self.engine_core.get_stats(request.include_block_map)
        except grpc.aio.AioRpcError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"scheduler GetStats failed: {e.code().name}: {e.details()}")


class FrontendServer:
    """A listening frontend; ``start()`` loads the tokenizer and connects."""

    def __init__(self, config: FrontendServiceConfig) -> None:
        self.config = config
        self.server = grpc.aio.server(options=SERVER_OPTIONS,
                                      interceptors=[DecodeErrorInterceptor()])
        self.health = health.aio.HealthServicer()
        auth = ApiKeyAuth(config.api_keys, config.admin_api_keys)
        self.servicer = GenerationServicer(auth)
        self.engine_core: EngineCells | None = None
        reasoning_parser = (None if config.reasoning_parser is None
                            else get_reasoning_parser(config.reasoning_parser))
        self.http_state = HttpState(self.servicer, auth, get_tool_parser(config.tool_call_parser),
                                    reasoning_parser)
        self.http: HttpServer | None = None
        if config.http_port is not None:
            self.http = HttpServer(build_app(self.http_state), config.host, config.http_port,
                                   config.tls)
        self._health_task: asyncio.Task | None = None
        self._health_poke = asyncio.Event()
        api_pb2_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (GENERATION_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )
        # The public API authenticates clients by API key, not by certificate.
        public_tls = None if config.tls is None else dataclasses.replace(config.tls, ca_file=None)
        self.port = bind(self.server, f"{config.host}:{config.port}", public_tls)
        if self.port == 0:
            raise OSError(f"could not bind {config.host}:{config.port}")

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def _set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in ("", GENERATION_SERVICE):
            await self.health.set(service, status)

    async def _watch_health(self) -> None:
        """SERVING while some cell's stream is up, its scheduler answers GetStats
        and has a worker; checked every second and at once when a stream goes
        up or down (``_health_poke``). Each check also sends requests that
        wait for a cell (a scheduler restarted or died) where they can go."""
        assert self.engine_core is not None
        serving = False
        while True:
            self._health_poke.clear()
            can_serve = await self.engine_core.refresh()
            if can_serve != serving:
                serving = self.http_state.cluster_serving = can_serve
                await self._set_serving(serving)
                logger.info("event=frontend_health serving=%s", serving)
            try:
                await asyncio.wait_for(self._health_poke.wait(), _HEALTH_CHECK_INTERVAL_S)
            except TimeoutError:
                pass

    async def start(self) -> None:
        """Listens (NOT_SERVING), loads the tokenizer, starts the scheduler streams.

        Liveness turns SERVING once the tokenizer is loaded; health ("") when
        a stream is up and its cell can serve, after this returns.
        """
        await self._set_serving(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        logger.info("event=frontend_listening address=%s http=%s", self.address,
                    self.http.url if self.http is not None else "off")
        engine, model_info = await asyncio.to_thread(self._build_engine)
        config = self.config
        self.engine_core = EngineCells(
            parse_scheduler_addresses(config.scheduler_address), model_info.name,
            engine.handle_outputs, engine.handle_lost, engine.current_request,
            tls=config.tls, cluster_secret=config.cluster_secret, redis_url=config.redis_url,
            prefill_weight=config.router_prefill_weight,
            request_weight=config.router_request_weight, cell_grace_s=config.cell_grace_s,
            resubmit_grace_s=config.resubmit_grace_s, on_change=self._health_poke.set)
        engine.attach(self.engine_core)
        if engine.stat_logger is not None:
            engine.stat_logger.observe_cells(self.engine_core)
        self.servicer.ready(engine, model_info, self.engine_core)
        await self.engine_core.start()
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._health_task = asyncio.create_task(self._watch_health(), name="frontend-health")
        logger.info("event=frontend_loaded model=%s max_model_len=%d vocab_size=%d schedulers=%s "
                    "prefix_routing=%s", model_info.name, model_info.max_model_len,
                    model_info.vocab_size, config.scheduler_address,
                    "redis" if config.redis_url else "off")

    def _build_engine(self) -> tuple[AsyncLLM, ModelInfo]:
        model_dir = resolve_model_dir(self.config.model)
        tokenizer = load_tokenizer(model_dir)
        chat_template = self._chat_template()
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        info = read_model_info(model_dir, self.config, load_eos_token_ids(model_dir, tokenizer))
        limits = self.config.request_limits
        if limits.max_prompt_bytes is None:  # what max_model_len tokens can stand for
            max_prompt_bytes = info.max_model_len * longest_token_bytes(tokenizer)
            limits = dataclasses.replace(limits, max_prompt_bytes=max_prompt_bytes)
        input_processor = InputProcessor(
            tokenizer, info.max_model_len, info.vocab_size, info.eos_token_ids,
            self.config.max_logprobs, limits,
            logits_processor_validators(self.config.logits_processors))
        output_processor = OutputProcessor(tokenizer, self.config.stream_interval)
        stat_logger = PrometheusStatLogger(info.name, info.max_model_len)
        return AsyncLLM(input_processor, output_processor, stat_logger), info

    def _chat_template(self) -> str | None:
        """The template that replaces the model's, or None to keep it."""
        if self.config.chat_template is not None:
            return load_chat_template(self.config.chat_template)
        if self.config.model is None:
            # SmolLM2's own template has no tools; this one renders the same without them.
            return load_chat_template(DEFAULT_MODEL_CHAT_TEMPLATE)
        return None

    async def stop(self, grace_s: float | None = 5.0) -> None:
        """NOT_SERVING, lets streams finish for ``grace_s``, then closes the scheduler stream."""
        await self.health.enter_graceful_shutdown()
        if self._health_task is not None:
            self._health_task.cancel()
        if self.http is None:
            await self.server.stop(grace_s)
        else:
            self.http_state.draining = True
            await asyncio.gather(self.server.stop(grace_s), self.http.stop(grace_s))
        if self.engine_core is not None:
            await self.engine_core.close()
        logger.info("event=frontend_stopped address=%s", self.address)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def serve_frontend(config: FrontendServiceConfig) -> FrontendServer:
    """Creates and starts a frontend; health turns SERVING once the scheduler stream is up."""
    server = FrontendServer(config)
    await server.start()
    return server


def parse_args(argv: list[str] | None = None) -> tuple[FrontendServiceConfig, str]:
    """The service's config and the log level."""
    p = argparse.ArgumentParser(prog="python -m services.frontend.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--scheduler-address", default="127.0.0.1:50052",
                   help="HOST:PORT[,HOST:PORT...] of every scheduler (cell), or a DNS name "
                        "that resolves to several (re-resolved every few seconds)")
    p.add_argument("--redis-url", default=None,
                   help="the cells' prefix index, to route requests to the cell that holds "
                        "their prefix (default: $KVMESH_REDIS_URL; \"\": none, route by load)")
    p.add_argument("--router-prefill-weight", type=float, default=1.0,
                   help="weight of a prompt token a cell would prefill against one token "
                        "of its load (see services/frontend/cell_routing.py)")
    p.add_argument("--router-request-weight", type=float, default=32.0,
                   help="tokens of load each request a cell holds counts for")
    p.add_argument("--cell-grace-s", type=float, default=1.0,
                   help="how long a lost cell's requests wait for it before another cell "
                        "takes them")
    p.add_argument("--model", default=None, help="HF model dir or .gguf file (default: SmolLM2)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--resubmit-grace-s", type=float, default=30.0,
                   help="how long requests wait for any scheduler before failing")
    RequestLimits.add_cli_args(p)
    p.add_argument("--logits-processors", nargs="*", default=[],
                   help="the workers' custom processors (module:Class): their "
                        "validate_params run at admission")
    p.add_argument("--chat-template", default=None,
                   help="a bundled template name (smollm2_tools), a file, or the template "
                        "text (default: the model's; the default model's tool-aware one)")
    p.add_argument("--tool-call-parser", default="hermes", choices=TOOL_PARSER_NAMES,
                   help="how tool calls are read from answers with tool_choice auto")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES,
                   help="split chat answers' reasoning (<think>...</think>) into "
                        "reasoning_content; constraints apply after it")
    add_security_args(p)
    p.add_argument("--http-port", type=int, default=8000,
                   help="the HTTP API (OpenAI, /metrics, /dashboard) on --host; 0: a free port")
    p.add_argument("--no-http", action="store_true", help="serve no HTTP API")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY[,KEY...]",
                   help="require one of these keys (repeatable; default: $KVMESH_API_KEY)")
    p.add_argument("--admin-api-key", action="append", default=None, metavar="KEY[,KEY...]",
                   help="keys for GetStats, /stats and /metrics, which show every tenant's "
                        "activity (default: $KVMESH_ADMIN_API_KEY)")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    return FrontendServiceConfig(
        host=args.host, port=args.port, scheduler_address=args.scheduler_address,
        model=args.model, max_model_len=args.max_model_len, max_logprobs=args.max_logprobs,
        stream_interval=args.stream_interval, resubmit_grace_s=args.resubmit_grace_s,
        redis_url=read_redis_url(args.redis_url),
        router_prefill_weight=args.router_prefill_weight,
        router_request_weight=args.router_request_weight, cell_grace_s=args.cell_grace_s,
        request_limits=RequestLimits.from_cli_args(args),
        logits_processors=args.logits_processors,
        chat_template=args.chat_template, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        tls=tls_from_args(args),
        cluster_secret=read_cluster_secret(args.cluster_secret_file),
        http_port=None if args.no_http else args.http_port,
        api_keys=parse_api_keys(args.api_key or [os.environ.get("KVMESH_API_KEY", "")]),
        admin_api_keys=parse_api_keys(
            args.admin_api_key or [os.environ.get("KVMESH_ADMIN_API_KEY", "")]),
    ), args.log_level


async def _main(config: FrontendServiceConfig) -> None:
    server = await serve_frontend(config)
    await wait_for_shutdown_signal()
    logger.info("event=frontend_draining address=%s", server.address)
    await server.stop()


def main(argv: list[str] | None = None) -> None:
    config, log_level = parse_args(argv)
    configure_logging(log_level)
    asyncio.run(_main(config))


if __name__ == "__main__":
    main()
