"""gRPC settings shared by every kvmesh server and channel.

One place for message size limits, keepalive and reconnect timing, the
invocation metadata keys, so that both ends of each stream agree, and how
every server answers a request body it cannot decode.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

# Prompt logprobs of long prompts are the big messages.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# The grpc.health.v1 service name every server reports as SERVING once its own
# start-up is done (listening; the frontend's tokenizer, the worker's model
# loaded) and until it drains, whatever its peers do: what a liveness probe
# asks. The whole-server status "" says whether it can serve, peers included
# (readiness), so a frontend whose scheduler is away is not restarted for it.
LIVENESS_SERVICE = "liveness"

# Invocation metadata a worker sends with WorkerStream: the id of its KV cache
# allocation (see services/scheduler/worker_stores.py). Not a proto field
# because it describes the connection's peer, not a message.
KV_CACHE_ID_METADATA_KEY = "kvmesh-kv-cache-id"

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Ping the long-lived streams so a vanished peer is noticed (and its
    # requests re-placed or aborted) within ~30 s, not at TCP timeout.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Clients ping every 10 s (CHANNEL_OPTIONS); accept that.
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    # Otherwise gRPC counts every ping on an idle stream as a strike and, after
    # two, sends GOAWAY "too_many_pings", breaking long-lived idle streams.
    ("grpc.http2.max_ping_strikes", 0),
)

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive pings detect a server that vanished without closing the stream
    # (a killed host, a dropped connection) within keepalive time + timeout;
    # they also keep a stream known-alive through a long CPU step.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Redial a restarted server within ~2 s instead of gRPC's default 120 s cap.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call whose request bytes are not the method's message with
    INVALID_ARGUMENT, instead of gRPC's UNKNOWN and a logged traceback.

    The handler gets raw bytes and the wrapper decodes them, so a decode
    error is the caller's mistake, answered as one.
    """

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _decoding_handler(handler, handler_call_details.method)


def _decoding_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    deserialize = handler.request_deserializer

    async def decode(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return deserialize(raw)
        except DecodeError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request body of {method} could not be decoded")

    async def decode_all(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext):
        async for raw in raws:
            yield await decode(raw, context)

    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        async def unary_unary(raw, context):
            return await handler.unary_unary(await decode(raw, context), context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, response_serializer=serialize)
    if handler.unary_stream is not None:
        async def unary_stream(raw, context):
            async for item in handler.unary_stream(await decode(raw, context), context):
                yield item
        return grpc.unary_stream_rpc_method_handler(unary_stream, response_serializer=serialize)
    if handler.stream_unary is not None:
        async def stream_unary(raws, context):
            return await handler.stream_unary(decode_all(raws, context), context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, response_serializer=serialize)

    async def stream_stream(raws, context):
        async for item in handler.stream_stream(decode_all(raws, context), context):
            yield item
    return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=serialize)
