"""Property-based fuzzing of the public gRPC API against the live cluster.

Any GenerateRequest Hypothesis makes, however wrong, gets one of the documented
status codes (OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED), never an internal
error or a hang; and a normal request still succeeds afterwards, with every
block free again.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.client import Client
from kvmesh.v1 import api_pb2, api_pb2_grpc, engine_pb2
from tests.chaos.conftest import wait_idle

pytestmark = pytest.mark.slow

DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
              grpc.StatusCode.RESOURCE_EXHAUSTED}
VOCAB_SIZE = 49152

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, 1.0, -1.0, 2.5, 1e30, math.nan]))
small_ints = st.integers(min_value=-5, max_value=300)
token_ids = st.lists(st.integers(min_value=-10, max_value=VOCAB_SIZE + 10), max_size=40)
texts = st.text(max_size=200)


@st.composite
def sampling_params(draw) -> engine_pb2.SamplingParams:
    params = engine_pb2.SamplingParams(
        top_k=draw(st.integers(-3, 100)), min_p=draw(floats), min_tokens=draw(small_ints),
        stop_token_ids=draw(token_ids), ignore_eos=draw(st.booleans()),
        presence_penalty=draw(floats), frequency_penalty=draw(floats),
        stop=draw(st.lists(texts, max_size=5)), output_kind=draw(st.integers(0, 5)),
        logit_bias=draw(st.dictionaries(st.integers(-5, VOCAB_SIZE + 5), floats, max_size=4)),
        allowed_token_ids=draw(st.lists(st.integers(-2, VOCAB_SIZE + 2), max_size=4)),
    )
    for name, strategy in (("n", st.integers(-2, 6)), ("temperature", floats),
                           ("top_p", floats), ("repetition_penalty", floats),
                           ("max_tokens", st.integers(-2, 12)), ("seed", st.integers(-5, 2**40)),
                           ("logprobs", st.integers(-2, 30)),
                           ("prompt_logprobs", st.integers(-2, 30))):
        if draw(st.booleans()):
            setattr(params, name, draw(strategy))
    return params


@st.composite
def generate_requests(draw) -> api_pb2.GenerateRequest:
    request = api_pb2.GenerateRequest(request_id=draw(texts), priority=draw(small_ints))
    kind = draw(st.sampled_from(["text", "chat", "token_ids", "none"]))
    if kind == "text":
        request.text = draw(texts)
    elif kind == "chat":
        for role, content in draw(st.lists(st.tuples(
                st.sampled_from(["user", "system", "assistant", "wizard", ""]), texts),
                max_size=4)):
            request.chat.messages.add(role=role, content=content)
    elif kind == "token_ids":
        request.token_ids.ids.extend(draw(token_ids))
    if draw(st.booleans()):
        request.sampling_params.CopyFrom(draw(sampling_params()))
    if draw(st.booleans()):
        request.cache_salt = draw(texts)
    return request


def test_any_request_gets_a_documented_status_and_the_cluster_serves_on(cluster, supervisor):
    seen: set[grpc.StatusCode] = set()
    with grpc.insecure_channel(cluster.address) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)

        @settings(max_examples=250, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(generate_requests())
        def check(request: api_pb2.GenerateRequest) -> None:
            try:
                for _ in stub.Generate(request, timeout=60):
                    pass
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            assert code in DOCUMENTED, (code, request)
            seen.add(code)

        check()
    assert {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT} <= seen
    with Client(cluster.address, timeout_s=60) as client:
        answer = client.complete("Hello there", max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(answer.outputs[0].token_ids) == 4
    wait_idle(cluster)
