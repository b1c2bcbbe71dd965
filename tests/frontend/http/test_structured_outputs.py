"""Structured outputs over HTTP with the official ``openai`` client: response_format,
``client.chat.completions.parse`` with a Pydantic model, vLLM's structured_outputs,
streamed and not, and 400s that name the field.

The model is a tiny random Llama: what it says is meaningless, so every
answer being valid shows the constraint, not the model, made it so.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.frontend.http.conftest import HttpStack

QUESTION = [{"role": "user", "content": "Describe a city."}]
SCHEMA = {"type": "object", "required": ["name", "population", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 10},
    "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["old", "big", "wet"]}}}}


class City(BaseModel):
    name: str = Field(max_length=10)
    country: Literal["FR", "IT", "DE"]
    population: int = Field(ge=0, le=10**7)


def test_parse_returns_a_pydantic_object(http_stack: HttpStack):
    client = http_stack.openai()
    completion = client.chat.completions.parse(
        model=http_stack.model, messages=QUESTION, response_format=City, temperature=0.0,
        max_tokens=128)
    city = completion.choices[0].message.parsed
    assert isinstance(city, City)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format_streamed_and_not(http_stack: HttpStack, temperature):
    client = http_stack.openai()
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    whole = client.chat.completions.create(
        model=http_stack.model, messages=QUESTION, response_format=response_format,
        temperature=temperature, seed=1, max_tokens=128)
    stream = client.chat.completions.create(
        model=http_stack.model, messages=QUESTION, response_format=response_format,
        temperature=temperature, seed=1, max_tokens=128, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    jsonschema.validate(json.loads(whole.choices[0].message.content), SCHEMA)
    assert streamed == whole.choices[0].message.content


def test_json_object_and_vllm_structured_outputs(http_stack: HttpStack):
    client = http_stack.openai()
    as_object = client.chat.completions.create(
        model=http_stack.model, messages=QUESTION, response_format={"type": "json_object"},
        temperature=0.0, max_tokens=64,
        extra_body={"structured_outputs": None})
    choice = client.completions.create(
        model=http_stack.model, prompt="Pick one:", temperature=1.0, seed=2, max_tokens=16,
        extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    regex = client.completions.create(
        model=http_stack.model, prompt="Code:", temperature=0.0, max_tokens=16,
        extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{3}"}})

    content = as_object.choices[0].message.content
    if as_object.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # a random model may write a long object; it still opens as one
        assert content.startswith("{")
    assert choice.choices[0].text in ("alpha", "beta", "gamma")
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", regex.choices[0].text)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs.regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= missing"}}},
     "structured_outputs.grammar"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_a_bad_constraint_is_a_400_naming_the_field(http_stack: HttpStack, extra, param):
    client = http_stack.openai()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=http_stack.model, messages=QUESTION,
                                       max_tokens=8, **extra)
    assert info.value.body["param"] == param
    assert param in info.value.body["message"]
