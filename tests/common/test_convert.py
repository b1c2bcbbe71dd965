import math

import pytest
from kvmesh.v1 import engine_pb2

from services.common import convert
from services.common.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
)
from services.common.limits import SchedulingLimits
from services.common.model_runner_output import ModelRunnerOutput, RequestFailure
from services.common.registration import WorkerRegistration
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


def _params() -> SamplingParams:
    return SamplingParams(
        n=2, temperature=0.5, top_p=0.5, top_k=5, min_p=0.25, seed=7, max_tokens=9,
        min_tokens=1, stop_token_ids=[3, 4], ignore_eos=True, logprobs=2, prompt_logprobs=0,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.5,
        logit_bias={5: 2.5}, allowed_token_ids=[1, 2], thinking_token_budget=8,
        stop=["x"], include_stop_str_in_output=True, skip_special_tokens=False,
        spaces_between_special_tokens=False, output_kind=RequestOutputKind.DELTA,
        detokenize=False, extra_args={"mode": "strict", "weights": [0.5, 2.0],
                                      "nested": {"on": True, "off": None}},
    )


def test_sampling_params_round_trip_keeps_none_and_zero_apart():
    params = _params()
    assert convert.sampling_params_from_proto(convert.sampling_params_to_proto(params)) == params
    unset = SamplingParams(max_tokens=None, prompt_logprobs=None)
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(unset))
    assert back.max_tokens is None and back.prompt_logprobs is None and back.seed is None


def _over_the_wire(msg: engine_pb2.SamplingParams) -> engine_pb2.SamplingParams:
    return engine_pb2.SamplingParams.FromString(msg.SerializeToString())


def test_unset_fields_take_vllm_defaults():
    # What a grpcurl or Node client sends when it names only max_tokens.
    back = convert.sampling_params_from_proto(_over_the_wire(engine_pb2.SamplingParams(
        max_tokens=8)))
    assert back == SamplingParams(max_tokens=8)
    assert (back.n, back.temperature, back.top_p, back.repetition_penalty) == (1, 1.0, 1.0, 1.0)
    assert back.skip_special_tokens is True and back.spaces_between_special_tokens is True
    assert back.detokenize is True and back.extra_args is None
    assert convert.sampling_params_from_proto(engine_pb2.SamplingParams()) == SamplingParams(
        max_tokens=None)


def test_explicit_zeros_and_falses_stay_apart_from_unset():
    msg = engine_pb2.SamplingParams(
        n=0, temperature=0.0, top_p=0.0, repetition_penalty=0.0, skip_special_tokens=False,
        spaces_between_special_tokens=False, detokenize=False)
    back = convert.sampling_params_from_proto(_over_the_wire(msg))
    # Zeros the validation rejects (n, top_p, repetition_penalty) reach it as zeros.
    assert (back.n, back.temperature, back.top_p, back.repetition_penalty) == (0, 0.0, 0.0, 0.0)
    assert (back.skip_special_tokens, back.spaces_between_special_tokens, back.detokenize) == (
        False, False, False)
    params = SamplingParams(temperature=0.0, skip_special_tokens=False,
                            spaces_between_special_tokens=False)
    wire = _over_the_wire(convert.sampling_params_to_proto(params))
    assert wire.HasField("temperature") and wire.HasField("skip_special_tokens")
    assert convert.sampling_params_from_proto(wire) == params


def test_extra_args_round_trip_numbers_arrive_as_floats():
    extra_args = {"name": "x", "flag": False, "none": None, "count": 3, "ratio": 0.25,
                  "ids": [1, 2, "three", [True]], "nested": {"deep": {"n": -7}}, "empty": {}}
    wire = _over_the_wire(convert.sampling_params_to_proto(SamplingParams(extra_args=extra_args)))
    back = convert.sampling_params_from_proto(wire).extra_args
    assert back == {"name": "x", "flag": False, "none": None, "count": 3.0, "ratio": 0.25,
                    "ids": [1.0, 2.0, "three", [True]], "nested": {"deep": {"n": -7.0}},
                    "empty": {}}
    assert [type(back[k]) for k in ("count", "ratio", "flag")] == [float, float, bool]
    assert [type(v) for v in back["ids"]] == [float, float, str, list]
    assert type(back["nested"]["deep"]["n"]) is float


def test_extra_args_none_and_empty_stay_apart():
    for extra_args in (None, {}):
        params = SamplingParams(extra_args=extra_args)
        msg = _over_the_wire(convert.sampling_params_to_proto(params))
        assert msg.HasField("extra_args") is (extra_args is not None)
        assert convert.sampling_params_from_proto(msg).extra_args == extra_args


def test_extra_args_non_finite_numbers_reach_validation():
    # json_format would raise here; the frontend's validation must see the value.
    msg = engine_pb2.SamplingParams(extra_args={"a": [math.nan], "b": math.inf})
    back = convert.sampling_params_from_proto(_over_the_wire(msg)).extra_args
    assert math.isnan(back["a"][0]) and back["b"] == math.inf


def test_engine_core_request_and_outputs_round_trip():
    req = EngineCoreRequest("r-1", [1, 2, 3], _params(), eos_token_id=2, arrival_time=1.5,
                            priority=3, cache_salt="s", client_index=4)
    assert convert.engine_core_request_from_proto(convert.engine_core_request_to_proto(req)) == req
    lp = Logprobs([[5, 1]], [[-0.5, -1.0]], [2])
    outs = EngineCoreOutputs(
        outputs=[
            EngineCoreOutput("a", [5], new_logprobs=lp, finish_reason=FinishReason.STOP,
                             stop_reason=5, num_cached_tokens=16),
            EngineCoreOutput("b", [], finish_reason=FinishReason.LENGTH, stop_reason="end",
                             finish_message="why", status_code=14),
            EngineCoreOutput("c", [7, 8]),
        ],
        engine_index=1, timestamp=2.0,
    )
    assert convert.engine_core_outputs_from_proto(convert.engine_core_outputs_to_proto(outs)) == outs


def test_scheduler_and_runner_outputs_round_trip():
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2], _params(), [1, 2], 0, [9])],
        scheduled_cached_reqs=CachedRequestData(["b"], [True], [[3, 4]], [17]),
        num_scheduled_tokens={"a": 2, "b": 1}, total_num_scheduled_tokens=3,
        finished_req_ids={"c"}, step_id=5,
    )
    assert convert.scheduler_output_from_proto(convert.scheduler_output_to_proto(sched)) == sched
    runner = ModelRunnerOutput(
        req_ids=["a", "b"], sampled_token_ids=[[], [4]],
        logprobs={"b": Logprobs([[4]], [[-0.25]], [1])},
        prompt_logprobs={"a": Logprobs([[2]], [[-2.0]], [3])}, step_id=5,
        failed={"c": RequestFailure(13, "logits are not finite")},
    )
    assert convert.model_runner_output_from_proto(convert.model_runner_output_to_proto(runner)) == runner


def test_draft_budgets_and_counts_round_trip():
    sched = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("a", [1, 2], _params(), [1], 0)],
        scheduled_cached_reqs=CachedRequestData(["b", "c"], [False, False], [[], []], [9, 4]),
        num_scheduled_tokens={"a": 2, "b": 5, "c": 1}, total_num_scheduled_tokens=8,
        step_id=3, num_draft_tokens={"b": 4})
    msg = convert.scheduler_output_to_proto(sched)
    assert list(msg.num_draft_tokens) == [0, 4, 0]
    assert convert.scheduler_output_from_proto(msg) == sched
    runner = ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[[], [4, 5, 6], [7]],
                               step_id=3, num_draft_tokens={"b": 4})
    assert convert.model_runner_output_from_proto(
        convert.model_runner_output_to_proto(runner)) == runner
    spec = WorkerRegistration("w", "m", "float32", 16, 64, 256, 256, [2],
                              num_speculative_tokens=5, speculative_disable_by_batch_size=8)
    got = convert.worker_message_from_proto(convert.registration_message(spec))
    assert (got.num_speculative_tokens, got.speculative_disable_by_batch_size) == (5, 8)
    del msg.num_draft_tokens[-1]
    with pytest.raises(ValueError, match="columns of different lengths"):
        convert.scheduler_output_from_proto(msg)


def test_step_messages_are_columns_and_misaligned_columns_are_refused():
    sched = SchedulerOutput(
        scheduled_cached_reqs=CachedRequestData(["a", "b", "c"], [False] * 3,
                                                [[], [7, 8], []], [5, 6, 7]),
        num_scheduled_tokens={"c": 1, "a": 1, "b": 1}, total_num_scheduled_tokens=3)
    msg = convert.scheduler_output_to_proto(sched)
    assert (list(msg.scheduled_cached_reqs.new_block_ids),
            list(msg.scheduled_cached_reqs.num_new_block_ids)) == ([7, 8], [0, 2, 0])
    assert convert.scheduler_output_from_proto(msg) == sched
    del msg.scheduled_cached_reqs.new_block_ids[-1]
    with pytest.raises(ValueError, match="cannot be split"):
        convert.scheduler_output_from_proto(msg)
    out = convert.model_runner_output_to_proto(
        ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[[3], []]))
    out.num_sampled_token_ids.append(1)
    with pytest.raises(ValueError, match="2 request ids but 3 token counts"):
        convert.model_runner_output_from_proto(out)


def test_registration_limits_round_trip_and_unreported_is_none():
    limits = SchedulingLimits(max_num_seqs=8, max_num_batched_tokens=512)
    reported = WorkerRegistration("w", "m", "float32", 16, 64, 256, 256, [2], limits)
    unreported = WorkerRegistration("w", "m", "float32", 16, 64, 256, 256, [2])
    for registration in (reported, unreported):
        message = convert.registration_message(registration)
        assert convert.worker_message_from_proto(message) == registration
    assert convert.registration_message(unreported).registration.max_num_seqs == 0


def test_half_reported_registration_limits_name_the_field():
    message = convert.registration_message(WorkerRegistration(
        "w", "m", "float32", 16, 64, 256, 256, [2], SchedulingLimits(max_num_seqs=8)))
    message.registration.max_num_seqs = 0
    with pytest.raises(ValueError, match="max_num_seqs is 0, must be an integer >= 1"):
        convert.worker_message_from_proto(message)
