"""Structured outputs beside the sampler: masks, replay, termination, failures alone.

Real grammars (xgrammar) on SmolLM2's tokenizer and random logits: whatever
the "model" prefers, a constrained row only ever samples what its grammar allows.
"""

from __future__ import annotations

import re

import grpc
import pytest
import torch

from services.common.sampling_params import SamplingParams, StructuredOutputsParams
from services.worker.grammar import GrammarBackend
from services.worker.sample import Sampler, SamplingState

CPU = torch.device("cpu")
VOCAB = 49152
EOS = 2


def constrained(**constraint) -> SamplingParams:
    return SamplingParams(temperature=0.0, structured_outputs=StructuredOutputsParams(**constraint))


def generate(state: SamplingState, outputs: list[list[int]], steps: int,
             seed: int = 0) -> dict[int, object]:
    """Samples ``steps`` tokens per row from random logits; returns the rows that failed."""
    sampler, failures = Sampler(), {}
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        md = state.make_sampling_metadata(len(outputs))
        out = sampler(torch.randn(len(outputs), VOCAB, generator=gen) * 5, md)
        failures.update(out.row_failures)
        # A row left with no token is found by the sampler, as the runner finds it.
        for row, empty in enumerate(out.nonfinite_rows.tolist()):
            if empty:
                failures.setdefault(row, out.nonfinite_reasons.get(row))
        for row, token in enumerate(out.sampled_token_ids.tolist()):
            if row not in failures:
                outputs[row].append(token)
    return failures


def test_constrained_rows_follow_their_grammar_and_end_with_eos(grammar, tokenizer):
    state = SamplingState(3, VOCAB, CPU, grammar=grammar)
    outputs: list[list[int]] = [[], [], []]
    state.add_request(0, constrained(choice=["Paris", "London", "New York"]), [1], outputs[0])
    state.add_request(1, constrained(regex=r"[0-9]{3}-[a-z]{2}"), [1], outputs[1])
    state.add_request(2, SamplingParams(temperature=0.0), [1], outputs[2])

    assert generate(state, outputs, steps=12) == {}

    for row, pattern in ((0, "Paris|London|New York"), (1, "[0-9]{3}-[a-z]{2}")):
        end = outputs[row].index(EOS)
        assert re.fullmatch(pattern, tokenizer.decode(outputs[row][:end]))
        # Once the grammar has ended, only the end-of-sequence token is allowed.
        assert set(outputs[row][end:]) == {EOS}
    assert outputs[2].count(EOS) < 12  # the free row is not forced


def test_free_rows_keep_their_logits(grammar):
    state = SamplingState(2, VOCAB, CPU, grammar=grammar)
    state.add_request(0, constrained(regex="abc"), [1], [])
    state.add_request(1, SamplingParams(temperature=0.0), [1], [])
    md = state.make_sampling_metadata(2)
    logits = torch.randn(2, VOCAB)
    free_row = logits[1].clone()
    for proc in md.logitsprocs.non_argmax_invariant:
        logits = proc.apply(logits)
    assert torch.equal(logits[1], free_row)
    assert torch.isinf(logits[0]).sum() > VOCAB - 100


def test_a_row_rejoining_the_batch_replays_its_output(grammar, tokenizer):
    """Preemption, re-placement on another worker: the matcher is rebuilt from the
    tokens the request already has, so it continues where it stopped."""
    prefix = tokenizer.encode('{"city": "Par', add_special_tokens=False)
    city = {"type": "string", "maxLength": 8}
    params = constrained(json={"type": "object", "properties": {"city": city},
                               "required": ["city"]}, disable_any_whitespace=True)
    state = SamplingState(1, VOCAB, CPU, grammar=grammar)
    output = list(prefix)
    state.add_request(0, params, [1], output)

    assert generate(state, [output], steps=40, seed=3) == {}

    text = tokenizer.decode(output[: output.index(EOS)])
    assert text.startswith('{"city": "Par') and text.endswith('"}')


def test_an_output_that_breaks_the_grammar_fails_its_request_alone(grammar, tokenizer):
    state = SamplingState(2, VOCAB, CPU, grammar=grammar)
    outputs = [tokenizer.encode("xyz", add_special_tokens=False), []]
    state.add_request(0, constrained(regex="abc"), [1], outputs[0])
    state.add_request(1, constrained(regex="abc"), [1], outputs[1])

    failures = generate(state, outputs, steps=1)

    assert list(failures) == [0]
    assert failures[0].status_code == grpc.StatusCode.INTERNAL.value[0]
    assert "breaks structured_outputs.regex" in failures[0].message
    assert len(outputs[1]) == 1


def test_a_constraint_that_does_not_compile_fails_its_request_alone(grammar):
    # The frontend refuses it first; the worker must not trust that.
    state = SamplingState(2, VOCAB, CPU, grammar=grammar)
    outputs: list[list[int]] = [[], []]
    state.add_request(0, constrained(grammar="root ::= undefined_rule"), [1], outputs[0])
    state.add_request(1, SamplingParams(temperature=0.0), [1], outputs[1])

    failures = generate(state, outputs, steps=2)

    assert list(failures) == [0]
    assert failures[0].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert failures[0].message.startswith("structured_outputs.grammar cannot be compiled")
    assert len(outputs[1]) == 2


def test_a_grammar_that_leaves_no_token_fails_with_the_reason(grammar, tokenizer):
    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    params = constrained(regex="[a-z]+")
    params.allowed_token_ids = digits  # no letter is allowed: nothing is left
    state = SamplingState(1, VOCAB, CPU, grammar=grammar)
    state.add_request(0, params, [1], [])

    failures = generate(state, [[]], steps=1)

    assert failures[0].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "no token is allowed next" in failures[0].message


def test_min_tokens_against_a_finished_grammar_fails_instead_of_sampling(grammar):
    params = constrained(choice=["a"])
    params.min_tokens = 5  # EOS is masked, and the grammar allows nothing else
    state = SamplingState(1, VOCAB, CPU, grammar=grammar, )
    output: list[int] = []
    state.add_request(0, params, [1], output, eos_token_id=EOS)

    failures = generate(state, [output], steps=3)

    assert list(failures) == [0] and "no token is allowed next" in failures[0].message


def test_a_worker_without_a_grammar_backend_refuses_constraints():
    state = SamplingState(1, VOCAB, CPU)
    with pytest.raises(ValueError, match="structured_outputs needs a worker with a grammar"):
        state.add_request(0, constrained(regex="a"), [1], [])


def test_the_constraint_applies_once_the_reasoning_has_ended(grammar, tokenizer):
    end = tokenizer.encode("</think>", add_special_tokens=False)
    params = constrained(regex="[0-9]{3}")
    params.structured_outputs.reasoning_end_token_ids = end
    state = SamplingState(1, VOCAB, CPU, grammar=grammar)
    output: list[int] = []
    state.add_request(0, params, [1], output)

    assert generate(state, [output], steps=6, seed=1) == {}
    assert not tokenizer.decode(output).isdigit()  # free while reasoning
    output += end  # the model ends its reasoning
    num_reasoning = len(output)
    assert generate(state, [output], steps=5, seed=2) == {}

    answer = output[num_reasoning:]
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(answer[: answer.index(EOS)]))
