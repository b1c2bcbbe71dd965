"""services/common/prometheus.py: vLLM's token buckets and the small /metrics server."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from services.common.prometheus import MetricsServer, build_1_2_5_buckets


def test_1_2_5_buckets_stop_at_the_maximum():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(256) == [1, 2, 5, 10, 20, 50, 100, 200]


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    writer.write_eof()  # a request cut short ends here, not at the server's read timeout
    await writer.drain()
    response = await reader.read()
    writer.close()
    return response


def test_serves_metrics_and_nothing_else():
    registry = CollectorRegistry()
    counter = Counter("kvmesh:test_events", "Test events.", registry=registry)

    async def scenario() -> list[bytes]:
        async with MetricsServer(registry, "127.0.0.1", 0) as server:
            counter.inc(3)
            return [await _http(server.port, request) for request in (
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                b"GET /metrics?format=text HTTP/1.0\r\n\r\n",
                b"GET / HTTP/1.1\r\n\r\n",
                b"POST /metrics HTTP/1.1\r\n\r\n",
                b"garbage",  # never a complete request: closed without an answer
            )]

    ok, with_query, root, post, garbage = asyncio.run(scenario())
    head, _, body = ok.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK") and b"Content-Type: text/plain" in head
    samples = {s.name: s.value for f in text_string_to_metric_families(body.decode())
               for s in f.samples}
    assert samples["kvmesh:test_events_total"] == 3
    assert with_query.startswith(b"HTTP/1.1 200 OK")
    assert root.startswith(b"HTTP/1.1 404") and post.startswith(b"HTTP/1.1 404")
    assert garbage == b""


def test_a_bad_port_is_refused():
    with pytest.raises(ValueError, match="metrics port is 70000"):
        MetricsServer(CollectorRegistry(), "127.0.0.1", 70000)
