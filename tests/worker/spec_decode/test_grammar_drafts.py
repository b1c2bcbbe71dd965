"""Drafts under a grammar: trimmed to what it accepts, extended by what it forces.

Real grammars (xgrammar) on SmolLM2's tokenizer. Whatever tokens a proposer
offers, the drafts a constrained request verifies extend its output validly,
and proposing leaves the matcher where it was.
"""

from __future__ import annotations

import random

import pytest
import xgrammar as xgr

from services.common.grammar import build_grammar
from services.common.sampling_params import SamplingParams, StructuredOutputsParams
from services.worker.grammar import GrammarBackend
from services.worker.sample import SamplingState
from services.worker.sample.logits_processor.structured_output import (
    StructuredOutputLogitsProcessor,
)

VOCAB = 49152


def processor_for(grammar: GrammarBackend, so: StructuredOutputsParams, output: list[int]):
    state = SamplingState(1, VOCAB, "cpu", grammar=grammar)
    state.add_request(0, SamplingParams(temperature=0.0, structured_outputs=so), [1], output)
    state.make_sampling_metadata(1)  # the processor takes the row
    return next(p for p in state.logitsprocs.all if isinstance(p, StructuredOutputLogitsProcessor))


def accepts(grammar: GrammarBackend, so: StructuredOutputsParams, tokens: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(grammar.compile(so).result())
    return all(matcher.accept_token(t) for t in tokens)


def test_forced_tokens_extend_the_draft(grammar, tokenizer):
    so = StructuredOutputsParams(regex=r"[0-9]{3}-fixed-suffix-[a-z]")
    output = tokenizer.encode("123")
    proc = processor_for(grammar, so, output)
    drafts = proc.constrain_drafts(0, [], 8)
    assert drafts and tokenizer.decode(drafts).startswith("-fixed")
    assert accepts(grammar, so, output + drafts)
    # Proposing left the matcher where it was: the same question, the same answer.
    assert proc.constrain_drafts(0, [], 8) == drafts


def test_drafts_are_cut_where_the_grammar_refuses(grammar, tokenizer):
    so = StructuredOutputsParams(choice=["Paris is big", "London is old"])
    output = tokenizer.encode("Paris")
    proc = processor_for(grammar, so, output)
    good = tokenizer.encode(" is big")
    assert proc.constrain_drafts(0, good, 8)[: len(good)] == good
    wrong = tokenizer.encode(" is old")
    drafts = proc.constrain_drafts(0, wrong, 8)
    is_ = tokenizer.encode(" is")
    assert drafts[: len(is_)] == is_ and tokenizer.decode(drafts, skip_special_tokens=True).strip() in (
        "is", "is big")
    assert accepts(grammar, so, output + drafts)


@pytest.mark.parametrize("seed", range(3))
def test_any_proposal_yields_a_valid_continuation(grammar, tokenizer, seed):
    """Random proposals mixed with valid text, at random points of a JSON output."""
    rng = random.Random(seed)
    schema = {"type": "object", "required": ["name", "age"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    so = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    text = '{"name": "Ada Lovelace", "age": 36}'  # xgrammar's compact separators
    full = tokenizer.encode(text)
    assert accepts(grammar, so, full), build_grammar(so)
    for _ in range(20):
        cut = rng.randrange(len(full))
        output = full[:cut]
        proc = processor_for(grammar, so, list(output))
        proposal = full[cut : cut + rng.randrange(1, 6)]
        if rng.random() < 0.5:  # a wrong token somewhere
            proposal[rng.randrange(len(proposal))] = rng.randrange(VOCAB)
        drafts = proc.constrain_drafts(0, proposal, 6)
        assert len(drafts) <= 6
        assert accepts(grammar, so, output + drafts)
