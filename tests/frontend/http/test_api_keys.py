"""API keys on a live frontend (``keyed`` in conftest), over gRPC and HTTP alike:
the same keys, the same refusals, and tenants that never share prefix-cache hits."""

from __future__ import annotations

import grpc
import openai
import pytest
from kvmesh.v1 import api_pb2, api_pb2_grpc

from tests.frontend.http.conftest import ADMIN_KEY, TENANT_KEYS, HttpStack
from tests.frontend.http.test_openai_api import get, post, random_prompt


def grpc_call(stack: HttpStack, method: str, request, key: str | None):
    metadata = (("authorization", f"Bearer {key}"),) if key is not None else ()
    with grpc.insecure_channel(stack.keyed.address) as channel:
        call = getattr(api_pb2_grpc.GenerationStub(channel), method)
        result = call(request, metadata=metadata, timeout=30)
        return list(result) if method == "Generate" else result


def grpc_error(stack: HttpStack, method: str, request, key: str | None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        grpc_call(stack, method, request, key)
    return info.value


GENERATE = api_pb2.GenerateRequest(text="hi")


def test_grpc_needs_a_key_and_get_stats_an_admin_key(http_stack: HttpStack):
    for key in (None, "wrong"):
        error = grpc_error(http_stack, "Generate", GENERATE, key)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "API key" in error.details()
    assert grpc_error(http_stack, "GetModelInfo", api_pb2.GetModelInfoRequest(), None).code() \
        == grpc.StatusCode.UNAUTHENTICATED
    chunks = grpc_call(http_stack, "Generate", GENERATE, TENANT_KEYS[0])
    assert chunks[-1].finished
    stats_request = api_pb2.GetStatsRequest()
    error = grpc_error(http_stack, "GetStats", stats_request, TENANT_KEYS[1])
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert [w.worker_id for w in grpc_call(http_stack, "GetStats", stats_request,
                                            ADMIN_KEY).workers] == ["w0"]


def test_http_refusals_are_openai_errors(http_stack: HttpStack):
    url = http_stack.keyed.http.url
    status, body, headers = post(url, "/v1/completions", {"prompt": "hi"})
    assert (status, body["error"]["code"], headers["www-authenticate"]) == (
        401, "invalid_api_key", "Bearer")
    assert body["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        http_stack.openai(http_stack.keyed, api_key="wrong").models.list()
    tenant = http_stack.openai(http_stack.keyed, api_key=TENANT_KEYS[0])
    assert tenant.models.list().data[0].id == http_stack.model
    # /stats and /metrics show every tenant's activity: admin only.
    for path in ("/stats", "/metrics"):
        assert get(url, path, {"Authorization": f"Bearer {TENANT_KEYS[0]}"})[0] == 403
        assert get(url, path, {"Authorization": f"Bearer {ADMIN_KEY}"})[0] == 200
        assert get(url, path)[0] == 401
    # Health, version and the dashboard page itself stay open.
    assert get(url, "/health")[0] == get(url, "/version")[0] == get(url, "/dashboard")[0] == 200


def cached_tokens(client: openai.OpenAI, model: str, prompt: list[int], **extra) -> int:
    response = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                         extra_body=extra)
    return response.usage.prompt_tokens_details.cached_tokens


def test_tenants_never_share_prefix_cache_hits(http_stack: HttpStack):
    http_stack.wait_idle()
    a, b = (http_stack.openai(http_stack.keyed, api_key=key) for key in TENANT_KEYS)
    prompt = random_prompt(seed=99, length=40)
    assert cached_tokens(a, http_stack.model, prompt) == 0
    assert cached_tokens(a, http_stack.model, prompt) == 32  # its own prefix: hit
    assert cached_tokens(b, http_stack.model, prompt) == 0  # the other tenant's: no hit
    assert cached_tokens(b, http_stack.model, prompt) == 32
    # Tenants that choose the same salt share on purpose.
    assert cached_tokens(a, http_stack.model, prompt, cache_salt="team") == 0
    assert cached_tokens(b, http_stack.model, prompt, cache_salt="team") == 32
    # Over gRPC, the same key gives the same salt: tenant a's HTTP prefix hits.
    request = api_pb2.GenerateRequest(token_ids=api_pb2.TokenIds(ids=prompt))
    request.sampling_params.max_tokens = 1
    (last,) = [c for c in grpc_call(http_stack, "Generate", request, TENANT_KEYS[0])
               if c.finished]
    assert last.metrics.num_cached_tokens == 32
