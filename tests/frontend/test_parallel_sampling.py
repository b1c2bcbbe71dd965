"""n > 1: fan-out into children, merge by index, abort, derived seeds."""

from __future__ import annotations

import pytest

from services.common.engine import EngineCoreOutput, FinishReason
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.parent_request import derive_child_seed

# Three different completions: "The sky", "The sea", "Blue."
CHILD_TOKENS = [[504, 6376], [504, 3426], [23390, 30]]


def fan_out(input_processor, output_processor, params, external_id="req"):
    request = input_processor.process_inputs(external_id, "Colour?", params)
    children = output_processor.add_client_request(request, "Colour?", external_id)
    return request, output_processor.parent_requests[request.request_id], children


def test_children_get_distinct_ids_and_derived_seeds(input_processor, output_processor):
    request, parent, children = fan_out(
        input_processor, output_processor, SamplingParams(n=3, seed=1234))
    assert [c.request_id for c in children] == [f"{i}_{request.request_id}" for i in range(3)]
    assert [c.sampling_params.seed for c in children] == [1234, 1235, 1236]
    assert all(c.sampling_params.n == 1 for c in children)
    assert all(c.prompt_token_ids == request.prompt_token_ids for c in children)
    assert request.sampling_params.n == 3  # the parent's params are left alone
    # Same seed -> same child seeds; no seed -> every child samples freshly.
    _, _, again = fan_out(input_processor, output_processor, SamplingParams(n=3, seed=1234), "b")
    assert [c.sampling_params.seed for c in again] == [1234, 1235, 1236]
    _, _, unseeded = fan_out(input_processor, output_processor, SamplingParams(n=3), "c")
    assert [c.sampling_params.seed for c in unseeded] == [None, None, None]


def test_n_equal_one_is_registered_as_itself(input_processor, output_processor):
    request = input_processor.process_inputs("solo", "Colour?", SamplingParams())
    assert output_processor.add_client_request(request, "Colour?", "solo") == [request]
    assert output_processor.request_states[request.request_id].external_req_id == "solo"
    assert not output_processor.parent_requests


def test_derived_seed_wraps_into_int64():
    assert derive_child_seed(2**63 - 1, 1) == -(2**63)
    assert derive_child_seed(None, 2) is None


def finish_children(output_processor, children, order):
    outputs = []
    for step in range(2):
        for index in order:
            tokens = CHILD_TOKENS[index]
            result = output_processor.process_outputs([EngineCoreOutput(
                children[index].request_id, [tokens[step]],
                finish_reason=FinishReason.LENGTH if step == 1 else None)])
            outputs.extend(result.request_outputs)
    return outputs


def test_final_only_merges_all_n_outputs_by_index(input_processor, output_processor):
    params = SamplingParams(n=3, max_tokens=2, output_kind=RequestOutputKind.FINAL_ONLY)
    _, _, children = fan_out(input_processor, output_processor, params)
    outputs = finish_children(output_processor, children, order=[2, 0, 1])

    assert len(outputs) == 1
    final = outputs[0]
    assert final.request_id == "req" and final.finished
    assert [o.index for o in final.outputs] == [0, 1, 2]
    assert [o.text for o in final.outputs] == ["The sky", "The sea", "Blue."]
    assert not output_processor.has_unfinished_requests()
    assert output_processor.parent_requests == {}


def test_delta_streams_each_child_chunk(input_processor, output_processor):
    params = SamplingParams(n=3, max_tokens=2, output_kind=RequestOutputKind.DELTA)
    _, _, children = fan_out(input_processor, output_processor, params)
    outputs = finish_children(output_processor, children, order=[0, 1, 2])

    assert [[(o.index, o.text) for o in out.outputs] for out in outputs] == [
        [(0, "The")], [(1, "The")], [(2, "Blue")],
        [(0, " sky")], [(1, " sea")], [(2, ".")]]
    assert [out.finished for out in outputs] == [False] * 5 + [True]


def test_cumulative_returns_the_latest_output_of_every_child(input_processor, output_processor):
    params = SamplingParams(n=3, max_tokens=2, output_kind=RequestOutputKind.CUMULATIVE)
    _, _, children = fan_out(input_processor, output_processor, params)
    outputs = finish_children(output_processor, children, order=[1, 0, 2])

    assert [[(o.index, o.text) for o in out.outputs] for out in outputs[:3]] == [
        [(1, "The")], [(0, "The"), (1, "The")], [(0, "The"), (1, "The"), (2, "Blue")]]
    assert [o.text for o in outputs[-1].outputs] == ["The sky", "The sea", "Blue."]
    assert outputs[-1].finished and not outputs[-2].finished


@pytest.mark.parametrize("abort_by", ["external", "parent"])
def test_aborting_the_parent_aborts_every_child(input_processor, output_processor, abort_by):
    request, _, children = fan_out(input_processor, output_processor, SamplingParams(n=3))
    output_processor.process_outputs([EngineCoreOutput(children[1].request_id, [504])])
    target = "req" if abort_by == "external" else request.request_id

    aborted = output_processor.abort_requests([target])

    assert aborted == [c.request_id for c in children]
    assert not output_processor.has_unfinished_requests()
    assert output_processor.parent_requests == {}
    assert output_processor.external_req_ids == {}
    late = output_processor.process_outputs([EngineCoreOutput(children[0].request_id, [504])])
    assert late.request_outputs == []
