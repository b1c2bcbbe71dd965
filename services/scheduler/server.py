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
import socket
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.process import configure_logging, wait_for_shutdown_signal
from services.common.prometheus import MetricsServer
from services.common.rpc import LIVENESS_SERVICE, SERVER_OPTIONS, DecodeErrorInterceptor
from services.common.security import (
    ClusterSecretInterceptor,
    TlsConfig,
    add_security_args,
    bind,
    read_cluster_secret,
    read_redis_url,
    redacted_url,
    tls_from_args,
)
from services.scheduler.config import SchedulerServiceConfig, SchedulingOptions
from services.scheduler.coordinator import Coordinator
from services.scheduler.servicer import EngineCoreServicer

logger = logging.getLogger(__name__)

ENGINE_CORE_SERVICE = scheduler_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
# Polling only happens while stopping: nothing on the serving path waits on it.
_DRAIN_POLL_S = 0.02


class SchedulerServer:
    """The EngineCore service plus grpc.health.v1 and reflection on one grpc.aio server."""

    def __init__(self, config: SchedulerServiceConfig) -> None:
        self.config = config
        self.coordinator = Coordinator(config)
        self.health = health.aio.HealthServicer()
        # The secret is checked first: an outsider learns nothing from decoding.
        interceptors = ([ClusterSecretInterceptor(config.cluster_secret)]
                        if config.cluster_secret else []) + [DecodeErrorInterceptor()]
        self._server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        scheduler_pb2_grpc.add_EngineCoreServicer_to_server(EngineCoreServicer(self.coordinator), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (ENGINE_CORE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )
        self.port = 0
        self.metrics_server: MetricsServer | None = None
        if config.metrics_port is not None:
            self.metrics_server = MetricsServer(self.coordinator.metrics.registry, config.host,
                                                config.metrics_port)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def start(self) -> None:
        """Binds and starts serving; health (liveness too) turns SERVING once listening."""
        self.port = bind(self._server, f"{self.config.host}:{self.config.port}", self.config.tls)
        if self.port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        await self._server.start()
        self.coordinator.start_cell(self._default_cell_id())
        if self.metrics_server is not None:
            await self.metrics_server.start()
        for service in ("", ENGINE_CORE_SERVICE, LIVENESS_SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        logger.info("event=scheduler_serving address=%s cell=%s redis=%s tls=%s cluster_secret=%s",
                    self.address, self.coordinator.cell_id,
                    redacted_url(self.config.redis_url) if self.config.redis_url else "in-memory",
                    _tls_mode(self.config.tls), "yes" if self.config.cluster_secret else "no")

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
        self.coordinator.stop_accepting()
        await self.coordinator.stop_cell()  # frontends route no new request here
        logger.info("event=scheduler_draining num_in_flight=%d", len(self.coordinator.placements))
        await _wait_until(lambda: not self.coordinator.placements, time.monotonic() + grace_s / 2)
        if drain_workers:
            self.coordinator.drain_workers()
            await _wait_until(lambda: not self.coordinator.sessions, deadline)
        await self._server.stop(max(deadline - time.monotonic(), 0.0))
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        logger.info("event=scheduler_stopped")

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()


    def _default_cell_id(self) -> str:
        """The listening address; on a wildcard host, this machine's name instead
        (a pod or container name: stable across restarts, unlike a wildcard)."""
        host = self.config.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = socket.gethostname()
        return f"{host}:{self.port}"


def _tls_mode(tls: TlsConfig | None) -> str:
    return "off" if tls is None else ("mutual" if tls.ca_file else "server")


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
    p.add_argument("--redis-url", default=d.redis_url,
                   help="redis[s]://[:PASSWORD@]HOST:PORT/DB (default: $KVMESH_REDIS_URL; "
                        "none: KV mirror in memory, no cell published)")
    p.add_argument("--cell-id", default=d.cell_id,
                   help="this scheduler's cell, stable across restarts (default: its address)")
    p.add_argument("--cell-lease-ttl-s", type=float, default=d.cell_lease_ttl_s,
                   help="how long the cell's Redis record outlives its last renewal")
    p.add_argument("--model", default=d.model, help="default: the first worker's model")
    SchedulingOptions.add_cli_args(p)
    p.add_argument("--load-weight-tokens", type=float, default=d.load_weight_tokens)
    p.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    add_security_args(p)
    p.add_argument("--worker-step-timeout-s", type=float, default=d.worker_step_timeout_s,
                   help="a worker that does not answer a step this long is declared lost")
    p.add_argument("--fault-exit-after-step", type=float, default=d.fault_exit_after_step,
                   help="fault injection for tests: probability of exiting (code 70) when "
                        "a worker's answer arrives, before it is applied; default 0 (off)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: a free one; default: off)")
    p.add_argument("--shutdown-grace-s", type=float, default=5.0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    config = SchedulerServiceConfig(
        host=args.host,
        port=args.port,
        redis_url=read_redis_url(args.redis_url),
        model=args.model,
        scheduling=SchedulingOptions.from_cli_args(args),
        load_weight_tokens=args.load_weight_tokens,
        max_logprobs=args.max_logprobs,
        worker_step_timeout_s=args.worker_step_timeout_s,
        fault_exit_after_step=args.fault_exit_after_step,
        tls=tls_from_args(args),
        cluster_secret=read_cluster_secret(args.cluster_secret_file),
        metrics_port=args.metrics_port,
        cell_id=args.cell_id,
        cell_lease_ttl_s=args.cell_lease_ttl_s,
    )
    return config, args


async def _serve_until_signalled(config: SchedulerServiceConfig, grace_s: float) -> None:
    server = await serve_scheduler(config)
    await wait_for_shutdown_signal()
    await server.stop(grace_s)


def main(argv: list[str] | None = None) -> None:
    config, args = parse_args(argv)
    configure_logging(args.log_level)
    asyncio.run(_serve_until_signalled(config, args.shutdown_grace_s))


if __name__ == "__main__":
    main()
