"""Public API sampling params: what a client leaves unset takes vLLM's default."""

from __future__ import annotations

from google.protobuf import json_format
from kvmesh.v1 import api_pb2

from services.common.sampling_params import SamplingParams
from services.frontend.api_convert import sampling_params_from_api


def _from_json(body: str) -> SamplingParams:
    """The params of a GenerateRequest written as grpcurl's JSON, after a wire round trip."""
    request = json_format.Parse(body, api_pb2.GenerateRequest())
    request = api_pb2.GenerateRequest.FromString(request.SerializeToString())
    return sampling_params_from_api(request.sampling_params, request.HasField("sampling_params"))


def test_unset_fields_take_vllm_defaults():
    params = _from_json('{"text": "hi", "sampling_params": {"max_tokens": 8}}')
    assert params == SamplingParams(max_tokens=8)
    assert params.skip_special_tokens is True and params.spaces_between_special_tokens is True
    assert (params.n, params.temperature, params.top_p, params.repetition_penalty) == (
        1, 1.0, 1.0, 1.0)


def test_explicit_values_are_kept():
    params = _from_json(
        '{"text": "hi", "sampling_params": {"temperature": 0, "skip_special_tokens": false,'
        ' "spaces_between_special_tokens": false, "n": 0, "extra_args": {"k": [1, "v"]}}}'
    )
    assert params.temperature == 0.0 and params.is_greedy
    assert (params.skip_special_tokens, params.spaces_between_special_tokens) == (False, False)
    assert params.n == 0  # left for validation to reject, not silently turned into 1
    assert params.extra_args == {"k": [1.0, "v"]}


def test_missing_sampling_params_is_every_default():
    assert _from_json('{"text": "hi"}') == SamplingParams()


def test_generate_always_detokenizes():
    params = _from_json('{"text": "hi", "sampling_params": {"detokenize": false}}')
    assert params.detokenize is True
