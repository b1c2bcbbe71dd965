"""The frontend refuses a constraint that cannot compile, naming the field; and
turns OpenAI's response_format and vLLM's structured_outputs into one constraint."""

from __future__ import annotations

import pytest

from services.common.sampling_params import StructuredOutputsParams
from services.common.validation import ValidationError
from services.frontend.http.response_format import structured_outputs_params
from services.frontend.structured_outputs import check_structured_outputs


@pytest.mark.parametrize("so, field, words", [
    (StructuredOutputsParams(json='{"type": "nope"}'), "structured_outputs.json",
     "is not a valid JSON schema: Unsupported type"),
    (StructuredOutputsParams(regex="(a"), "structured_outputs.regex",
     "is not a valid regular expression"),
    (StructuredOutputsParams(grammar="root ::= x"), "structured_outputs.grammar",
     "is not a valid EBNF grammar"),
])
def test_a_constraint_that_cannot_compile_is_refused(so, field, words):
    with pytest.raises(ValidationError, match=words) as info:
        check_structured_outputs(so)
    assert info.value.field == field


def test_response_format_json_schema_becomes_a_json_constraint():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    so = structured_outputs_params(
        {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}},
        None)
    assert so == StructuredOutputsParams(json=schema)
    assert structured_outputs_params({"type": "json_object"}, None) == StructuredOutputsParams(
        json_object=True)
    assert structured_outputs_params({"type": "text"}, None) is None
    assert structured_outputs_params(None, {"choice": ["a", "b"]}) == StructuredOutputsParams(
        choice=["a", "b"])


@pytest.mark.parametrize("response_format, structured_outputs, field", [
    ({"type": "xml"}, None, "response_format.type"),
    ({"type": "json_schema"}, None, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}, None,
     "response_format.json_schema.schema"),
    (None, {"regex": "(a"}, "structured_outputs.regex"),
    (None, {"choice": []}, "structured_outputs.choice"),
    (None, {"regexp": "a"}, "structured_outputs.regexp"),
    (None, {}, "structured_outputs"),
    ({"type": "json_object"}, {"regex": "a"}, "structured_outputs"),
])
def test_bad_http_constraints_name_the_field(response_format, structured_outputs, field):
    with pytest.raises(ValidationError) as info:
        structured_outputs_params(response_format, structured_outputs)
    assert info.value.field == field
    assert field in str(info.value)
