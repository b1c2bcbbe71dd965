"""The internal plane is closed: the cluster secret on every EngineCore call, mutual TLS.

Real scheduler, worker and frontend services on loopback; the outsiders are
raw gRPC clients without the secret or without a client certificate.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2

from kvmesh.v1 import api_pb2, api_pb2_grpc, engine_pb2, scheduler_pb2_grpc
from services.common.convert import add_request_message
from services.common.security import TlsConfig, aio_channel, secret_metadata
from services.frontend.config import FrontendServiceConfig
from services.frontend.server import serve_frontend
from tests.certs import make_tls
from tests.e2e.tiny_model import save_tiny_llama as save_tiny_llama_with_tokenizer
from tests.grpc_utils import (
    greedy_request,
    health_status,
    reference_tokens,
    start_scheduler,
    start_worker,
    wait_until,
)

SECRET = "s3cret-for-tests"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture(scope="module")
def model_with_tokenizer(tmp_path_factory, default_model_dir):
    """A tiny random Llama carrying SmolLM2's tokenizer, which a frontend needs."""
    return save_tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tiny_llama_tok"),
                                          default_model_dir)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


async def frontend_stream_error(address: str, metadata=()) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        call = scheduler_pb2_grpc.EngineCoreStub(channel).FrontendStream(metadata=metadata)
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:  # the write may already fail
            await call.write(add_request_message(greedy_request("sneaky", [1, 2, 3], 4)))
            await call.read()
        return excinfo.value.code()


def test_calls_without_the_cluster_secret_are_unauthenticated(model_dir):
    async def scenario():
        server = await start_scheduler(cluster_secret=SECRET)
        try:
            codes = [await frontend_stream_error(server.address),
                     await frontend_stream_error(server.address, secret_metadata("wrong"))]
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = scheduler_pb2_grpc.EngineCoreStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await stub.GetStats(api_pb2.GetStatsRequest())
                codes.append(excinfo.value.code())
                stats = await stub.GetStats(api_pb2.GetStatsRequest(),
                                            metadata=secret_metadata(SECRET))
            # A worker with the wrong secret is refused, and says so.
            intruder = start_worker(server.address, model_dir, "intruder", cluster_secret="wrong")
            with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                await intruder.task
            codes.append(excinfo.value.code())
            health = await health_status(server.address, "")  # probes need no secret
            return codes, stats, health
        finally:
            await server.stop(0.1)

    codes, stats, health = run(scenario())
    assert codes == [UNAUTHENTICATED] * 4
    assert list(stats.workers) == []
    assert health == health_pb2.HealthCheckResponse.SERVING


def test_a_cluster_over_mutual_tls_with_a_secret_serves_and_refuses_bare_clients(
        model_with_tokenizer, tmp_path):
    model_dir = model_with_tokenizer
    server_tls, client_tls = make_tls(tmp_path)
    request = greedy_request("r", [3, 4, 5, 6, 7], 10)
    expected = reference_tokens(model_dir, [request])["r"]

    async def scenario():
        scheduler = await start_scheduler(tls=server_tls, cluster_secret=SECRET)
        worker = start_worker(scheduler.address, model_dir, "w0", tls=client_tls,
                              cluster_secret=SECRET)
        frontend = await serve_frontend(FrontendServiceConfig(
            port=0, scheduler_address=scheduler.address, model=str(model_dir),
            max_model_len=256, tls=server_tls, cluster_secret=SECRET, http_port=0))
        await wait_until(lambda: len(scheduler.coordinator.sessions) == 1)
        await frontend.engine_core.wait_connected(10)
        # A client of the public API needs only the CA (no client certificate).
        async with aio_channel(frontend.address, _ca_only(client_tls), ()) as channel:
            generate = api_pb2.GenerateRequest(request_id="r", sampling_params=_greedy_params(10),
                                               token_ids=api_pb2.TokenIds(ids=[3, 4, 5, 6, 7]))
            responses = [r async for r in api_pb2_grpc.GenerationStub(channel).Generate(generate)]
        # The HTTP API is served over TLS too, with the same certificate.
        context = ssl.create_default_context(cafile=client_tls.ca_file)
        models = await asyncio.to_thread(_get_json, f"{frontend.http.url}/v1/models", context)
        # With the secret but no client certificate, the scheduler's TLS refuses.
        bare = aio_channel(scheduler.address, _ca_only(client_tls), ())
        with pytest.raises(grpc.aio.AioRpcError) as excinfo:
            await scheduler_pb2_grpc.EngineCoreStub(bare).GetStats(
                api_pb2.GetStatsRequest(), metadata=secret_metadata(SECRET), timeout=5)
        await bare.close()
        await frontend.stop(0.1)
        await scheduler.stop(1.0)
        await worker.task
        return responses, excinfo.value.code(), models, frontend.http.url

    responses, bare_code, models, http_url = run(scenario())
    assert http_url.startswith("https://") and models[0]["id"] == str(model_dir)
    assert [t for r in responses for o in r.outputs for t in o.token_ids] == expected
    assert bare_code == grpc.StatusCode.UNAVAILABLE  # the TLS handshake fails


def _greedy_params(max_tokens: int) -> engine_pb2.SamplingParams:
    return engine_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                     output_kind=engine_pb2.DELTA)


def _ca_only(tls: TlsConfig) -> TlsConfig:
    return TlsConfig(ca_file=tls.ca_file)


def _get_json(url: str, context: ssl.SSLContext) -> list[dict]:
    with urllib.request.urlopen(url, context=context, timeout=10) as response:
        return json.loads(response.read())["data"]
