"""StructuredOutputsParams: one constraint, on the wire unchanged, refused by field."""

from __future__ import annotations

import pytest

from services.common.convert import sampling_params_from_proto, sampling_params_to_proto
from services.common.grammar import build_grammar
from services.common.sampling_params import SamplingParams, StructuredOutputsParams
from services.common.validation import (
    MAX_STRUCTURED_OUTPUT_CHARS,
    ValidationError,
    validate_sampling_params,
)

CONSTRAINTS = [
    StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}}),
    StructuredOutputsParams(regex=r"\d+", disable_any_whitespace=True,
                            reasoning_end_token_ids=[7, 8]),
    StructuredOutputsParams(choice=["yes", "no", 'say "hi"\n']),
    StructuredOutputsParams(grammar='root ::= "a" | "b"'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
        "type": "const_string", "value": "x"}}),
]


@pytest.mark.parametrize("so", CONSTRAINTS, ids=lambda so: so.kind)
def test_every_constraint_crosses_the_wire_unchanged_and_compiles(so):
    params = SamplingParams(structured_outputs=so)
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params
    validate_sampling_params(params, vocab_size=100)
    build_grammar(so)


def test_a_schema_keeps_its_property_order():
    # xgrammar emits properties in the schema's order: it must not be sorted.
    assert CONSTRAINTS[0].json == '{"type": "object", "properties": {"b": {}, "a": {}}}'


@pytest.mark.parametrize("so, field, words", [
    (StructuredOutputsParams(), "structured_outputs", "exactly one"),
    (StructuredOutputsParams(regex="a", choice=["a"]), "structured_outputs", "exactly one"),
    (StructuredOutputsParams(choice=[]), "structured_outputs.choice", "non-empty list"),
    (StructuredOutputsParams(choice=["a", 1]), "structured_outputs.choice", "list of strings"),
    (StructuredOutputsParams(regex=""), "structured_outputs.regex", "non-empty string"),
    (StructuredOutputsParams(grammar="x" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)),
     "structured_outputs.grammar", "at most 65536 characters"),
])
def test_a_malformed_constraint_is_refused_naming_the_field(so, field, words):
    with pytest.raises(ValidationError, match=words) as info:
        validate_sampling_params(SamplingParams(structured_outputs=so), vocab_size=100)
    assert info.value.field == field


def test_the_wire_keeps_an_empty_choice_list_to_refuse_it():
    params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=[]))
    assert sampling_params_from_proto(sampling_params_to_proto(params)) == params


@pytest.mark.parametrize("so, reason", [
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json="[1]"), "a JSON schema is an object or a boolean"),
    (StructuredOutputsParams(json='{"type": "objectx"}'), 'Unsupported type "objectx"'),
    (StructuredOutputsParams(regex="a(b"), "parenthesis is not closed"),
    (StructuredOutputsParams(grammar="root ::= rule2"), 'Rule "rule2" is not defined'),
    (StructuredOutputsParams(structural_tag="{}"), "format"),
])
def test_an_invalid_constraint_says_why(so, reason):
    with pytest.raises(ValueError, match=reason):
        build_grammar(so)
