"""Structured outputs on the real SmolLM2-135M-Instruct, in process (slow: loads the model).

Whatever the model would say, a constrained output is valid: 50 JSON schemas
drawn at random each validate (jsonschema), greedy and sampled; regex and
choice outputs match; asynchronous and synchronous scheduling give the same
tokens; preempted constrained requests resume valid; a constraint that cannot
be met fails alone.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from kvmesh.offline import LLM, SamplingParams
from services.common.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow

PATTERNS = ("^[A-Z][a-z]{1,6}$", "^[0-9]{2,4}$", "^(red|green|blue)$",
            "^[a-z]{1,8}@[a-z]{1,8}\\.com$")
NAMES = ("name", "age", "city", "tags", "score", "active", "id", "kind", "items", "meta")


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """Nested objects, arrays, enums, bounded numbers, optional fields, string patterns.

    Strings and arrays are bounded: an unbounded string is valid only once
    closed, and a sampled model may never close it within max_tokens.
    """
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern"]
    kinds += ["object", "array"] if depth < 2 else []
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 1000])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        values = ["alpha", "beta", "gamma", "delta", 1, 2.5, True, None]
        return {"enum": rng.sample(values, rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1),
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(NAMES, rng.randint(1, 4))
    return {"type": "object", "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.7]}


def object_schemas(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    schemas = [random_schema(rng) for _ in range(count)]
    return [s if s.get("type") == "object"
            else {"type": "object", "properties": {"value": s}, "required": ["value"]}
            for s in schemas]


def ask_for(schema: dict) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with JSON for this schema: {json.dumps(schema)}"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=64, num_kv_blocks=1024, device="cpu")


def test_fifty_random_json_schemas_validate_greedy_and_sampled(llm):
    schemas = object_schemas(seed=0, count=50)
    greedy = [SamplingParams(temperature=0.0, max_tokens=256,
                             structured_outputs=StructuredOutputsParams(json=s)) for s in schemas]
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=256,
                              structured_outputs=StructuredOutputsParams(json=s))
               for i, s in enumerate(schemas)]
    conversations = [ask_for(s) for s in schemas]

    outputs = llm.chat(conversations * 2, greedy + sampled, use_tqdm=False)

    for schema, output in zip(schemas * 2, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_regex_and_choice_outputs_match(llm):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    constraints = [StructuredOutputsParams(regex=r"[A-Z]{3}-[0-9]{2,4}"),
                   StructuredOutputsParams(choice=["Paris", "London", "Rome"]),
                   StructuredOutputsParams(grammar='root ::= "yes" | "no" | "maybe"')]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=32, structured_outputs=so)
              for t in (0.0, 1.0) for so in constraints]

    outputs = llm.chat([question] * len(params), params, use_tqdm=False)

    patterns = [r"[A-Z]{3}-[0-9]{2,4}", "Paris|London|Rome", "yes|no|maybe"] * 2
    for pattern, output in zip(patterns, outputs):
        assert re.fullmatch(pattern, output.outputs[0].text), output.outputs[0].text


def test_async_and_sync_scheduling_give_the_same_constrained_tokens(llm):
    sync = LLM(max_num_seqs=8, num_kv_blocks=256, device="cpu", async_scheduling=False)
    schemas = object_schemas(seed=1, count=4)
    params = [SamplingParams(temperature=0.0, max_tokens=128,
                             structured_outputs=StructuredOutputsParams(json=s)) for s in schemas]
    conversations = [ask_for(s) for s in schemas]

    expected = [o.outputs[0].token_ids for o in sync.chat(conversations, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.chat(conversations, params, use_tqdm=False)]

    assert got == expected


def test_preempted_constrained_requests_resume_valid():
    # 24 blocks of 16 tokens for 8 requests that each need 4 to 8: preemption.
    small = LLM(max_num_seqs=8, num_kv_blocks=24, device="cpu")
    schema = {"type": "object", "required": ["values"], "properties": {
        "values": {"type": "array", "minItems": 12, "maxItems": 12,
                   "items": {"type": "integer", "minimum": 0, "maximum": 99999}}}}
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=160,
                            structured_outputs=StructuredOutputsParams(
                                json=schema, disable_any_whitespace=True))

    outputs = small.chat([ask_for(schema)] * 8, params, use_tqdm=False)

    assert small.llm_engine.engine_core.scheduler.make_stats().num_preemptions > 0
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0].text
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


def test_a_constraint_that_cannot_be_met_fails_alone(llm):
    tokenizer = llm.get_tokenizer()
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    impossible = SamplingParams(temperature=0.0, max_tokens=8, allowed_token_ids=digits,
                                structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    fine = SamplingParams(temperature=0.0, max_tokens=8,
                          structured_outputs=StructuredOutputsParams(regex="[0-9]+"))

    failed, served = llm.generate(["Count:", "Count:"], [impossible, fine], use_tqdm=False)

    assert failed.outputs[0].finish_reason == "abort"
    assert failed.outputs[0].finish_message.startswith(
        "no token is allowed next: structured_outputs.regex forbids every token")
    assert re.fullmatch("[0-9]+", served.outputs[0].text)
