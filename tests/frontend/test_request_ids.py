"""External (client) vs internal (engine) request ids."""

from __future__ import annotations

import re

from services.common.engine import EngineCoreOutput, FinishReason
from services.common.sampling_params import SamplingParams
from services.frontend.input_processor import external_request_id, make_internal_request_id


def test_internal_id_is_external_plus_random_hex():
    internal = make_internal_request_id("chat-42")
    assert re.fullmatch(r"chat-42-[0-9a-f]{8}", internal)
    assert external_request_id(internal) == "chat-42"
    assert external_request_id("no-suffix") == "no-suffix"


def add_twice(input_processor, output_processor):
    requests = [input_processor.process_inputs("dup", "Hello", SamplingParams()) for _ in range(2)]
    for request in requests:
        output_processor.add_request(request, "Hello")
    return [r.request_id for r in requests]


def test_duplicate_external_ids_get_distinct_internal_ids(input_processor, output_processor):
    first, second = add_twice(input_processor, output_processor)
    assert first != second
    assert output_processor.external_req_ids["dup"] == [first, second]

    result = output_processor.process_outputs([
        EngineCoreOutput(first, [504], finish_reason=FinishReason.LENGTH),
        EngineCoreOutput(second, [6376], finish_reason=FinishReason.LENGTH),
    ])
    # Both reach the client under its own id, each with its own text.
    assert [(o.request_id, o.outputs[0].text) for o in result.request_outputs] == [
        ("dup", "The"), ("dup", " sky")]
    assert output_processor.external_req_ids == {}


def test_abort_by_internal_id_leaves_the_sibling(input_processor, output_processor):
    first, second = add_twice(input_processor, output_processor)
    assert output_processor.abort_requests([first]) == [first]
    assert list(output_processor.request_states) == [second]
    assert output_processor.external_req_ids["dup"] == [second]


def test_abort_by_external_id_aborts_every_request_under_it(input_processor, output_processor):
    first, second = add_twice(input_processor, output_processor)
    assert output_processor.abort_requests(["dup", "unknown"]) == [first, second]
    assert not output_processor.has_unfinished_requests()
    assert output_processor.abort_requests(["dup", first]) == []


def test_explicit_external_id_wins(input_processor, output_processor):
    request = input_processor.process_inputs("x", "Hello", SamplingParams())
    output_processor.add_request(request, "Hello", external_req_id="client-7")
    assert output_processor.abort_requests(["client-7"]) == [request.request_id]
