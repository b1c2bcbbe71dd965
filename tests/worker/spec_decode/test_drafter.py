"""The drafter backs off requests whose drafts keep failing, and probes them again."""

from __future__ import annotations

import numpy as np

from services.common.speculative import SpeculativeConfig
from services.worker.spec_decode import Drafter, DraftState

TOKENS = np.array([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])


def test_low_acceptance_drafts_only_every_probe_interval():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2,
                                        min_acceptance_rate=0.5, probe_interval=4))
    state = DraftState()
    drafter.propose(state, TOKENS)
    assert state.token_ids == [3, 4, 1]
    for _ in range(10):  # every draft rejected: the rate decays below 0.5
        drafter.record(state, 3, 0)
    assert state.acceptance_rate < 0.5
    drafted = []
    for _ in range(8):
        drafter.propose(state, TOKENS)
        drafted.append(bool(state.token_ids))
    assert drafted == [False, False, False, True] * 2
    for _ in range(10):  # the probes are accepted: drafting every step again
        drafter.record(state, 3, 3)
    drafter.propose(state, TOKENS)
    assert state.token_ids == [3, 4, 1]


def test_the_grammar_has_the_last_word():
    drafter = Drafter(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2))
    state = DraftState()
    drafter.propose(state, TOKENS, constrain=lambda drafts, k: drafts[:1] + [42])
    assert state.token_ids == [3, 42]
