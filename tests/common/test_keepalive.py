"""Long-lived idle streams survive the clients' keepalive pings."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.rpc import SERVER_OPTIONS

# Pings far more often than any kvmesh client does, so strikes would add up fast.
_PINGING_CLIENT = (
    ("grpc.keepalive_time_ms", 500),
    ("grpc.keepalive_timeout_ms", 1_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


async def _idle_stream_outlives(server_options, seconds: float) -> None:
    server = grpc.aio.server(options=server_options)
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=_PINGING_CLIENT)
    call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())

    async def consume() -> None:
        async for _ in call:
            pass

    try:
        with pytest.raises(asyncio.TimeoutError):  # still open: no GOAWAY broke it
            await asyncio.wait_for(consume(), seconds)
    finally:
        await channel.close()
        await server.stop(0)


def test_idle_stream_is_not_closed_for_too_many_pings():
    """Every kvmesh server uses these options (scheduler, frontend)."""
    asyncio.run(_idle_stream_outlives(SERVER_OPTIONS, seconds=6.0))
