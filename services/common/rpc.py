"""gRPC settings shared by every kvmesh server and channel.

One place for message size limits, keepalive and reconnect timing, and the
invocation metadata keys, so that both ends of each stream agree.
"""

from __future__ import annotations

# Prompt logprobs of long prompts are the big messages.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

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
