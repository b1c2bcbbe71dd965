"""Structured outputs across real processes: over gRPC the same tokens as in process,
unchanged by a worker SIGKILLed mid-generation (the survivor replays each
request's output into a fresh matcher), INVALID_ARGUMENT naming the field,
and a constraint that cannot be met failing alone.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from kvmesh.client import Client
from kvmesh.cluster import LocalCluster
from kvmesh.offline import LLM, SamplingParams
from services.common.sampling_params import StructuredOutputsParams
from tests.e2e.helpers import (
    TINY_MAX_MODEL_LEN,
    TINY_MAX_NUM_SEQS,
    all_blocks_free,
    prompts,
    sigkill_a_busy_worker,
    tiny_cluster_config,
    wait_for,
)

pytestmark = pytest.mark.slow

# Long enough to be cut mid-way: exactly 24 numbers, compact.
SCHEMA = {"type": "object", "required": ["values"], "properties": {"values": {
    "type": "array", "minItems": 24, "maxItems": 24,
    "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}
CONSTRAINT = dict(json=SCHEMA, disable_any_whitespace=True)
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def cluster(make_cluster, tiny_model_dir, tmp_path_factory) -> LocalCluster:
    config = tiny_cluster_config(tiny_model_dir, tmp_path_factory.mktemp("logs"),
                                 num_workers=2, num_frontends=1)
    return make_cluster(config)


def generate(client: Client, prompt: list[int]) -> tuple[list[int], str]:
    tokens, text = [], ""
    for chunk in client.generate(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                 **CONSTRAINT):
        tokens += chunk.outputs[0].token_ids
        text += chunk.outputs[0].text
    return tokens, text


def test_over_grpc_the_same_tokens_as_in_process(cluster, tiny_model_dir):
    token_prompts = prompts(10, 3)
    llm = LLM(str(tiny_model_dir), dtype="float32", max_model_len=TINY_MAX_MODEL_LEN,
              max_num_seqs=TINY_MAX_NUM_SEQS, num_kv_blocks=64, device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(**CONSTRAINT))
    expected = [o.outputs[0].token_ids
                for o in llm.generate([{"prompt_token_ids": p} for p in token_prompts],
                                      params, use_tqdm=False)]
    client = Client(cluster.frontend_addresses[0], timeout_s=60)

    got = [generate(client, p) for p in token_prompts]

    assert [tokens for tokens, _ in got] == expected
    for _, text in got:
        jsonschema.validate(json.loads(text), SCHEMA)
    client.close()


def test_sigkill_a_worker_mid_generation_keeps_every_constrained_output(cluster):
    client = Client(cluster.frontend_addresses[0], timeout_s=60)
    token_prompts = prompts(11, 4)
    with ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda p: generate(client, p), token_prompts))
    first_tokens_seen = []

    def stream(prompt: list[int]) -> tuple[list[int], str]:
        tokens, text = [], ""
        for chunk in client.generate(token_ids=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0.0, **CONSTRAINT):
            tokens += chunk.outputs[0].token_ids
            text += chunk.outputs[0].text
            if len(tokens) >= 8 and not first_tokens_seen:
                first_tokens_seen.append(True)
        return tokens, text

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, p) for p in token_prompts]
        wait_for(lambda: bool(first_tokens_seen), timeout_s=60, what="8 tokens streamed")
        sigkill_a_busy_worker(cluster, client)
        got = [f.result(timeout=120) for f in futures]

    assert got == expected
    wait_for(lambda: all_blocks_free(client), what="blocks freed")
    client.close()


@pytest.mark.parametrize("constraint, field", [
    (dict(json='{"type": "nope"}'), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= missing"), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
])
def test_a_bad_constraint_is_invalid_argument_naming_the_field(cluster, constraint, field):
    client = Client(cluster.frontend_addresses[0], timeout_s=60)
    with pytest.raises(grpc.RpcError) as info:
        list(client.generate("hi", max_tokens=4, **constraint))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details()
    client.close()


def test_a_constraint_that_cannot_be_met_fails_alone(cluster):
    client = Client(cluster.frontend_addresses[0], timeout_s=60)
    digits = client.tokenize("0123456789", add_special_tokens=False)

    def impossible() -> None:
        list(client.generate("Count:", max_tokens=8, temperature=0.0, regex="[a-z]+",
                             allowed_token_ids=digits))

    with ThreadPoolExecutor(2) as pool:
        failing = pool.submit(impossible)
        served = pool.submit(lambda: generate(client, prompts(12, 1)[0]))
        with pytest.raises(grpc.RpcError) as info:
            failing.result(timeout=60)
        tokens, text = served.result(timeout=120)

    assert "no token is allowed next" in info.value.details()
    jsonschema.validate(json.loads(text), SCHEMA)
    client.close()
