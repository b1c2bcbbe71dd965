"""The scheduler service: kvmesh.v1.EngineCore over grpc.aio, with health and reflection.

``python -m services.scheduler.server --port 50052 --redis-url redis://... --model M``
runs it until SIGTERM or SIGINT, then drains: NOT_SERVING, new requests
refused (UNAVAILABLE), in-flight requests given the grace period to finish,
workers told to Drain, then the server stops.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.registration import WorkerRegistration
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine_core import EngineCore
from services.scheduler.request_queue import SchedulingPolicy
from services.scheduler.servicer import EngineCoreServicer

logger = logging.getLogger(__name__)

ENGINE_CORE_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # prompt logprobs of long prompts are the big messages
SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Ping the long-lived streams so a vanished worker or frontend is noticed
    # (and its requests re-placed or aborted) within ~30 s, not at TCP timeout.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Workers and frontends ping every 10 s; accept that.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    # Otherwise gRPC counts every ping on an idle stream as a strike and, after
    # two, sends GOAWAY "too_many_pings", breaking long-lived idle streams.
    ("grpc.http2.max_ping_strikes", 0),
)
# Polling only happens while stopping: nothing on the serving path waits on it.
_DRAIN_POLL_S = 0.02


@dataclass(slots=True, kw_only=True)
class SchedulerServiceConfig:
    """How the scheduler service listens, mirrors KV state, and schedules each worker.

    ``port`` 0 picks a free port (``SchedulerServer.port`` tells which).
    ``redis_url`` None keeps the KV mirror in memory. ``model`` namespaces the
    Redis keys and must equal what workers report; None adopts the first
    worker's. The scheduling fields apply to every worker's Scheduler, each
    capped by the ``max_num_seqs`` / ``max_num_batched_tokens`` the worker reports.
    ``max_num_waiting`` bounds each worker's waiting queue (0: unbounded).
    ``load_weight_tokens``: how many prefix-hit tokens one queued request on a
    worker is worth when placing requests (see router.Router).
    """

    host: str = "127.0.0.1"
    port: int = 50052
    redis_url: str | None = None
    model: str | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    max_num_waiting: int = 0
    enable_prefix_caching: bool = True
    load_weight_tokens: float = 32.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port is {self.port}, must be in [0, 65535]")
        if self.load_weight_tokens < 0:
            raise ValueError(f"load_weight_tokens is {self.load_weight_tokens}, must be >= 0")
        # Fail at start-up, not at the first registration: the scheduling
        # fields are validated by building a config for a smallest worker.
        self.scheduler_config(WorkerRegistration("probe", "", "", 1, 2, 2, 1, []), 0)

    def scheduler_config(self, registration: WorkerRegistration, engine_index: int) -> SchedulerConfig:
        """One worker's SchedulerConfig: its pool geometry and length, our limits capped
        by its own."""
        return SchedulerConfig(
            num_blocks=registration.num_blocks,
            block_size=registration.block_size,
            max_model_len=registration.max_model_len,
            # Never more than the worker's batch buffers hold.
            max_num_batched_tokens=min(self.max_num_batched_tokens,
                                       registration.max_num_batched_tokens or self.max_num_batched_tokens),
            max_num_seqs=min(self.max_num_seqs, registration.max_num_seqs or self.max_num_seqs),
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy,
            enable_prefix_caching=self.enable_prefix_caching,
            engine_index=engine_index,
            max_num_waiting=self.max_num_waiting,
        )


class SchedulerServer:
    """The EngineCore service plus grpc.health.v1 and reflection on one grpc.aio server."""

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.engine = EngineCore(config)
        self.health = health.aio.HealthServicer()
        self._server = grpc.aio.server(options=SERVER_OPTIONS)
        scheduler_pb2_grpc.add_EngineCoreServicer_to_server(EngineCoreServicer(self.engine), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (ENGINE_CORE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port = 0

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        """Binds and starts serving; health turns SERVING once listening."""
        self.port = self._server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        await self._server.start()
        for service in ("", ENGINE_CORE_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info("event=scheduler_serving address=%s redis=%s", self.address,
                    "yes" if self.config.redis_url else "in-memory")

    async def stop(self, grace: float | None = 5.0, *, drain_workers: bool = True) -> None:
        """Drains, then stops the server.

        NOT_SERVING and new requests refused at once; requests in flight get
        up to half of ``grace`` to finish; then workers are told to Drain (what
        is still running is refused with UNAVAILABLE) and the server stops.
        With ``drain_workers`` False the workers are not told to leave: their
        streams just end and they dial the next scheduler (a restart).
        """
        grace_s = grace or 0.0
        deadline = time.monotonic() + grace_s
        await self.health.enter_graceful_shutdown()
        self.engine.stop_accepting()
        logger.info("event=scheduler_draining num_in_flight=%d", len(self.engine.placements))
        await _wait_until(lambda: not self.engine.placements, time.monotonic() + grace_s / 2)
        if drain_workers:
            self.engine.drain_workers()
            await _wait_until(lambda: not self.engine.sessions, deadline)
        await self._server.stop(max(deadline - time.monotonic(), 0.0))
        logger.info("event=scheduler_stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


async def _wait_until(done: Callable[[], bool], deadline: float) -> None:
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(_DRAIN_POLL_S)


async def serve_scheduler(config: SchedulerServiceConfig) -> SchedulerServer:
    """Builds and starts a SchedulerServer; ``await server.stop()`` ends it."""
    server = SchedulerServer(config)
    await server.start()
    return server


# ---------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> tuple[SchedulerServiceConfig, argparse.Namespace]:
    d = SchedulerServiceConfig()
    p = argparse.ArgumentParser(prog="python -m services.scheduler.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port")
    p.add_argument("--redis-url", default=d.redis_url, help="default: KV mirror in memory")
    p.add_argument("--model", default=d.model, help="default: the first worker's model")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
    p.add_argument("--policy", default=d.policy,
                   choices=[policy.value for policy in SchedulingPolicy])
    p.add_argument("--max-num-waiting", type=int, default=d.max_num_waiting, help="0: unbounded")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--load-weight-tokens", type=float, default=d.load_weight_tokens)
    p.add_argument("--shutdown-grace-s", type=float, default=5.0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    config = SchedulerServiceConfig(
        host=args.host,
        port=args.port,
        redis_url=args.redis_url,
        model=args.model,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        policy=args.policy,
        max_num_waiting=args.max_num_waiting,
        enable_prefix_caching=not args.no_prefix_caching,
        load_weight_tokens=args.load_weight_tokens,
    )
    return config, args


async def _serve_until_signalled(config: SchedulerServiceConfig, grace_s: float) -> None:
    server = await serve_scheduler(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace_s)


def main(argv: list[str] | None = None) -> None:
    config, args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(_serve_until_signalled(config, args.shutdown_grace_s))


if __name__ == "__main__":
    main()
