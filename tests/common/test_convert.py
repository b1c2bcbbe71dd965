from services.common import convert
from services.common.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    Logprobs,
)
from services.common.outputs import ModelRunnerOutput
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
        detokenize=False,
    )


def test_sampling_params_round_trip_keeps_none_and_zero_apart():
    params = _params()
    assert convert.sampling_params_from_proto(convert.sampling_params_to_proto(params)) == params
    unset = SamplingParams(max_tokens=None, prompt_logprobs=None)
    back = convert.sampling_params_from_proto(convert.sampling_params_to_proto(unset))
    assert back.max_tokens is None and back.prompt_logprobs is None and back.seed is None


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
    )
    assert convert.model_runner_output_from_proto(convert.model_runner_output_to_proto(runner)) == runner
