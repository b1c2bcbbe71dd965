"""The drafter drafts what pays for its verification, and probes what does not."""

from __future__ import annotations

import numpy as np

from services.common.speculative import SpeculativeConfig
from services.worker.spec_decode import Drafter, DraftState

TOKENS = np.array([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2])
CONFIG = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, probe_interval=4)


def test_without_measured_costs_every_proposal_is_drafted():
    drafter = Drafter(CONFIG)
    state = DraftState(acceptance_rate=0.0)
    drafter.propose(state, TOKENS)
    assert state.token_ids == [3, 4, 5]


def test_drafts_only_as_many_as_their_acceptance_repays():
    drafter = Drafter(CONFIG)
    drafter.step_costs = [1.0, 1.05, 1.1, 1.15]  # weights read once: drafts nearly free
    assert drafter.num_worth_drafting(0.8, 3) == 3
    assert drafter.num_worth_drafting(0.03, 3) == 0  # 1.03 tokens for 1.05 of a step
    drafter.step_costs = [1.0, 1.9, 2.8, 3.7]  # rows cost their own work: drafts dear
    assert drafter.num_worth_drafting(0.95, 3) == 1
    assert drafter.num_worth_drafting(0.8, 3) == 0
    assert drafter.num_worth_drafting(0.95, 0) == 0


def test_a_request_no_draft_pays_for_probes_every_interval_then_recovers():
    drafter = Drafter(CONFIG)
    drafter.step_costs = [1.0, 1.1, 1.2, 1.3]
    state = DraftState()
    for _ in range(10):  # every draft rejected: the rate decays until nothing pays
        drafter.record(state, 3, 0)
    drafted = []
    for _ in range(8):
        drafter.propose(state, TOKENS)
        drafted.append(bool(state.token_ids))
    assert drafted == [False, False, False, True] * 2
    for _ in range(10):  # the probes are accepted: drafting every step again
        drafter.record(state, 3, 3)
    drafter.propose(state, TOKENS)
    assert state.token_ids == [3, 4, 5]


def test_the_grammar_has_the_last_word():
    drafter = Drafter(CONFIG)
    state = DraftState()
    drafter.propose(state, TOKENS, constrain=lambda drafts, k: drafts[:1] + [42])
    assert state.token_ids == [3, 42]
